"""The engine layer: running a model. Forwards and the signals read from logits (forward,
signals), loading models (models), precision, the rollout backends and their seam (rollout,
rollout_vllm), the passes a plan asks for (passes), the enumeration pass (exactvalue) and the
continuation pass (continuations), the allocator setting (cpu_memory). It imports the credit layer,
never data, train, analysis or integrations.
"""

"""Worker-side signals in verl (ACPO's ``mode_prob``, ARCA's ``hidden_residual``): an FSDP engine
registered in verl's ``EngineRegistry`` under a model type of its own.

verl's actor engine (``FSDPEngineWithLMHead``) returns ``log_probs`` and, on request, ``entropy``
from its forward; a calibrator that reads more of the forward gets it from this subclass, which
a run selects with ``+actor_rollout_ref.model.model_type=tokencredit_language_model`` (verl builds
the actor's engine with ``EngineRegistry.new(model_type, backend)``; nothing of verl is patched).
Without the trainer mode's request it behaves exactly like verl's engine. On a micro-batch that
carries the request (non-tensor keys ``tokencredit_mode_prob`` / ``tokencredit_hidden_residual``,
which the trainer mode sets for the actor update when the spec's plan has these signals):

* ``mode_prob`` (ACPO): ``p*_t = max_v softmax(z_t / tau)`` from the logits of the same forward,
  computed by the core's :func:`tokencredit.engine.signals.token_signals` (chunked, no grad);
* ``hidden_residual`` (ARCA, LoRA only): ``||h_on_t - h_off_t||_2`` of the hidden state the LM
  head reads (captured by a forward pre-hook on ``get_output_embeddings()``), ``h_on`` from the
  forward itself (detached), ``h_off`` from one extra no-grad forward of the same inputs inside
  verl's own ``engine.disable_adapter()`` (the context verl's LoRA reference policy uses).

Both are returned in ``model_output`` laid out like ``log_probs`` (position i of a sequence scores
token i + 1; nested by sequence), so the loss (:func:`.losses.loss_signals`) un-pads them exactly as
verl's ``ppo_loss`` un-pads the log-probs. They are the *current* policy's, per micro-batch of the
update, detached, as the entropy TACO and STARE read in verl.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, Tuple

import torch

from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from ...engine.signals import token_signals
from .settings import ENGINE_MODEL_TYPE, WORKER_SIGNAL_KEYS

__all__ = ["ENGINE_MODEL_TYPE", "WORKER_SIGNAL_KEYS", "TokenCreditFSDPEngine", "requested_signals", "verl_engine_devices"]


def requested_signals(micro_batch) -> Tuple[str, ...]:
    """The worker signals a micro-batch asks for (its non-tensor request keys)."""
    return tuple(s for s, k in WORKER_SIGNAL_KEYS.items() if tu.get_non_tensor_data(data=micro_batch, key=k, default=False))


def _uniform_temperature(temperature) -> float:
    """The one sampling temperature of a micro-batch (the core's token_signals takes a scalar)."""
    if not isinstance(temperature, torch.Tensor):
        return float(temperature)
    t = temperature.detach().reshape(-1).float()
    if t.numel() == 0 or not bool((t == t[0]).all()):
        raise ValueError(f"temperature: mode_prob expects one temperature per micro-batch, got {t.unique().tolist()}")
    return float(t[0])


def _to_full(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def verl_engine_devices(backends=("fsdp", "fsdp2")) -> list:
    """The device keys (``"cuda"``, ``"npu"``, ``("cuda", vendor)``, ...) verl's own FSDP language-model
    engine is registered for in this process: tokencredit's engine serves wherever verl's does
    (a platform plugin that registers verl's engines for its device, such as the CPU dry run's
    :mod:`tokencredit.integrations.verl_cpu`, is imported before this plugin by ``VERL_USE_EXTERNAL_MODULES``)."""
    import verl.workers.engine  # noqa: F401 (registers verl's engines)

    keys = []
    for backend in backends:
        for key, cls in EngineRegistry._engines.get("language_model", {}).get(backend, {}).items():
            if cls is FSDPEngineWithLMHead and key not in keys:
                keys.append(key)
    return keys or ["cuda", "npu"]


def _register(engine_class):
    """Register ``engine_class`` under every (backend, device key) of verl's FSDP language-model engine."""
    registry = EngineRegistry._engines.setdefault(ENGINE_MODEL_TYPE, {})
    for backend in ("fsdp", "fsdp2"):
        for key in verl_engine_devices((backend,)):
            registry.setdefault(backend, {})[key] = engine_class
    return engine_class


@_register
class TokenCreditFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP actor engine, plus ``mode_prob`` and ``hidden_residual`` in ``model_output``
    on request (see the module docstring)."""

    # -- build: verl's builder branches on model_type, which here is our own name --------------

    def _build_module(self):
        kept = self.model_config.model_type
        self.model_config.model_type = "language_model"  # build exactly verl's language model
        try:
            return super()._build_module()
        finally:
            self.model_config.model_type = kept

    # -- the hook that reads the LM head's input --------------------------------------------

    def _tc_head_hook(self, module, args):
        cap = getattr(self, "_tc_capture", None)
        if cap is None:
            return None
        h = _to_full(args[0]).detach()
        if cap.get("off") is None:  # the adapter-off forward runs first
            cap["off"] = h
        else:  # the forward itself: reduce to the per-token norm right away, drop h_off
            off = cap.pop("off")
            cdt = torch.promote_types(torch.promote_types(h.dtype, off.dtype), torch.float32)
            cap["norm"] = torch.linalg.vector_norm(h.to(cdt) - off.to(cdt), dim=-1)
            cap["off"] = None
        return None

    def _tc_install_hook(self) -> None:
        if getattr(self, "_tc_hooked", None) is self.module:
            return
        head = self.module.get_output_embeddings()
        if head is None:
            raise ValueError(f"hidden_residual: the actor model {type(self.module).__name__} has no output embedding (LM head) to read")
        head.register_forward_pre_hook(self._tc_head_hook)
        self._tc_hooked = self.module

    # -- the forward ---------------------------------------------------------------------------

    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        self._tc_capture = None
        want = requested_signals(micro_batch)
        if want and tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
            raise ValueError(
                f"tokencredit worker signals {list(want)} read the logits and the LM head's input, which verl's fused "
                f"kernels never materialise: set actor_rollout_ref.model.use_fused_kernels=False"
            )
        if "hidden_residual" in want:
            if not getattr(self, "_is_lora", False):
                raise ValueError(
                    "hidden_residual (ARCA): expected a LoRA actor (actor_rollout_ref.model.lora_rank > 0), got none"
                )
            self._tc_install_hook()
            self._tc_capture = {"off": None}
            from verl.utils.device import get_device_name

            autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
            autocast = (
                nullcontext() if autocast_dtype == torch.float32 else torch.autocast(device_type=get_device_name(), dtype=autocast_dtype)
            )
            # the adapter-off forward of the same inputs, as verl's LoRA reference pass runs it
            with torch.no_grad(), self.disable_adapter(), autocast:
                self.module(**model_inputs, use_cache=False)
            if self._tc_capture.get("off") is None:
                raise RuntimeError("hidden_residual: the LM head's forward hook did not fire in the adapter-off forward")
        output_args["tokencredit_want"] = want
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        want = output_args.get("tokencredit_want", ())
        if not want:
            return model_output
        cap, self._tc_capture = self._tc_capture, None
        if "mode_prob" in want:
            model_output["mode_prob"] = self._tc_mode_prob(output, output_args, micro_batch)
        if "hidden_residual" in want:
            if cap is None or cap.get("norm") is None:
                raise RuntimeError("hidden_residual: the LM head's forward hook did not fire in the actor's forward")
            model_output["hidden_residual"] = self._tc_nested(cap["norm"], output_args, micro_batch)
        return model_output

    # -- per-position tensors in verl's layout -----------------------------------------------

    def _tc_mode_prob(self, output, output_args, micro_batch) -> torch.Tensor:
        tau = _uniform_temperature(micro_batch["temperature"])
        with torch.no_grad():
            logits = _to_full(output.logits).detach()
            if logits.dim() == 2:
                logits = logits.unsqueeze(0)
            # the sampled tokens do not enter max_v p_v; any valid id serves the core's signature
            tokens = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
            p = token_signals(logits, tokens, temperature=tau, want=("mode_prob",))["mode_prob"]
        return self._tc_nested(p, output_args, micro_batch)

    def _tc_nested(self, x: torch.Tensor, output_args: Dict, micro_batch) -> torch.Tensor:
        """A per-position tensor of the forward ([1, nnz(+pad)] packed or [B, Lmax] padded) ->
        nested [B, j1] by sequence, as verl lays out ``log_probs``."""
        use_remove_padding = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        cu_seqlens = micro_batch["input_ids"].offsets()
        if use_remove_padding:
            flat = self._gather_and_unpad_packed(x.reshape(-1), output_args["pad_size"])
        else:
            lens = cu_seqlens.diff().tolist()
            flat = torch.cat([x[b, :n] for b, n in enumerate(lens)])
        return torch.nested.nested_tensor_from_jagged(flat, cu_seqlens)


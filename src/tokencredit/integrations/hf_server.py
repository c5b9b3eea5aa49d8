"""The server of the ``tc_hf`` rollout (:mod:`tokencredit.integrations.verl_cpu`): a causal LM that
generates with transformers ``generate`` behind verl's token-in, token-out server interface.

Kept apart from :mod:`.verl_cpu` and free of verl imports at module level: Ray imports this module
in the server's process by the class's reference, and a module that imported verl first would
load verl's plugins before the CPU platform is registered.

What it serves, as verl's vLLM server does (``vllm_async_server.py``, verl 0.9.1):

* ``generate(prompt_ids, sampling_params)``: ``temperature``, ``top_p``, ``top_k`` (``-1`` = off),
  ``max_tokens`` (default: the rollout's ``response_length``, capped by the prompt + response
  budget); returns the sampled ids with their log-probs at the sampling temperature (before top-p /
  top-k truncation) and ``extra_fields["global_steps"]``, the trainer step of the weights used;
* ``prompt_logprobs=0`` (verl's distillation teacher): ``extra_fields["prompt_ids"]`` /
  ``["prompt_logprobs"]`` in vLLM's layout, row ``i`` the log-prob of token ``i + 1`` of the
  sequence and that token's id, a dummy ``[0.0]`` / ``[0]`` row last; top-k prompt log-probs
  (``prompt_logprobs > 0``) are refused;
* ``load_weights``: the actor's weights after each step (verl's weight-update path).

Requests that arrive together (verl's agent loop sends a step's samples concurrently) with the same
settings are generated as one left-padded batch.
"""

from __future__ import annotations

import asyncio
import os
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["HFRolloutServer"]


class HFRolloutServer:
    """One replica's server: a causal LM on the CPU, generating with transformers ``generate``."""

    def __init__(self, model_path: str, *, response_length: int, prompt_length: int, dtype: str = "float32",
                 max_batch: int = 64, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(max(1, int(os.environ.get("TC_HF_ROLLOUT_THREADS", "1"))))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                          trust_remote_code=trust_remote_code)
        self.model.eval()
        tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else tok.eos_token_id
        self.eos_ids = sorted(set(eos if isinstance(eos, (list, tuple)) else [eos]))
        self.response_length, self.prompt_length = int(response_length), int(prompt_length)
        self.max_batch = max_batch
        self.version = 0
        self.global_steps = 0  # the trainer step whose weights generate (verl reads it per output)
        self._queue: List[Tuple[List[int], Dict, asyncio.Future]] = []
        self._lock: Optional[asyncio.Lock] = None  # made in the serving loop (Ray's actor loop)
        self._lock_loop = None

    # -- weights --------------------------------------------------------------------------------

    def load_weights(self, named_tensors, global_steps: Optional[int] = None) -> int:
        state = dict(named_tensors)
        _, unexpected = self.model.load_state_dict(state, strict=False)
        unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
        if unexpected:
            raise ValueError(f"tc_hf rollout: weights for parameters the model does not have: {unexpected[:5]}")
        self.version += 1
        if global_steps is not None:
            self.global_steps = int(global_steps)
        return len(state)

    def weights_version(self) -> int:
        return self.version

    # -- requests -------------------------------------------------------------------------------

    def _settings(self, prompt: List[int], params: Dict) -> Tuple:
        """(greedy, temperature, top_p, top_k, max_new_tokens, prompt_logprobs) of one request."""
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1) or -1)
        top_p = float(params.get("top_p", 1.0))
        budget = self.prompt_length + self.response_length - len(prompt)
        max_new = params.get("max_tokens", params.get("max_new_tokens"))
        max_new = min(self.response_length, budget) if max_new is None else int(max_new)
        max_new = max(1, max_new)
        plp = params.get("prompt_logprobs")
        if plp is not None and int(plp) > 0:
            raise ValueError(f"tc_hf rollout: prompt_logprobs: expected 0 (the scored token's log-prob), got {plp}")
        greedy = temperature <= 0.0 or top_k == 1 or not params.get("do_sample", True)
        return (greedy, temperature, top_p, top_k, max_new, plp is not None)

    async def generate(self, prompt_ids, sampling_params, request_id=None, image_data=None, video_data=None, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data:
            raise ValueError("tc_hf rollout: multimodal inputs are not supported")
        fut = asyncio.get_running_loop().create_future()
        prompt = [int(t) for t in prompt_ids]
        self._queue.append((prompt, dict(sampling_params), fut))
        await asyncio.sleep(0)  # let the other requests of this wave enqueue
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:
            if not fut.done():
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
                await asyncio.to_thread(self._run, batch)
        ids, lps, extra = await fut
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps, **extra})

    def _run(self, batch) -> None:
        groups: Dict[Tuple, list] = {}
        for item in batch:
            groups.setdefault(self._settings(item[0], item[1]), []).append(item)
        for settings, items in groups.items():
            try:
                results = self._generate([p for p, _, _ in items], settings)
            except Exception as e:  # every waiting request gets the error; none hangs
                for _, _, fut in items:
                    fut.get_loop().call_soon_threadsafe(_set, fut, None, e)
                continue
            for (_, _, fut), r in zip(items, results):
                fut.get_loop().call_soon_threadsafe(_set, fut, r, None)

    @torch.no_grad()
    def _generate(self, prompts: List[List[int]], settings: Tuple):
        greedy, temperature, top_p, top_k, max_new, prompt_logprobs = settings
        B, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros(B, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        kw = dict(max_new_tokens=max_new, pad_token_id=self.pad_id, eos_token_id=self.eos_ids,
                  output_logits=True, return_dict_in_generate=True)
        if greedy:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0)
        out = self.model.generate(input_ids=ids, attention_mask=attn, **kw)
        seq = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # raw logits, before temperature and truncation
        if not greedy:
            logits = logits / temperature
        lp = torch.log_softmax(logits, dim=-1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)
        prompt_rows = self._prompt_logprobs(ids, attn, prompts) if prompt_logprobs else [None] * B
        results = []
        for i in range(B):
            toks = seq[i].tolist()
            n = len(toks)
            for j, t in enumerate(toks):
                if t in self.eos_ids:
                    n = j + 1
                    break
            extra = {} if prompt_rows[i] is None else {"prompt_ids": prompt_rows[i][0], "prompt_logprobs": prompt_rows[i][1]}
            results.append((toks[:n], [float(x) for x in lp[i, :n]], extra))
        return results

    def _prompt_logprobs(self, ids: torch.Tensor, attn: torch.Tensor, prompts: List[List[int]]):
        """vLLM's prompt log-prob rows (``prompt_logprobs=0``) for each left-padded prompt."""
        position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
        logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=attn, position_ids=position_ids).logits.float(), -1)
        width = ids.shape[1]
        rows = []
        for i, p in enumerate(prompts):
            start = width - len(p)
            nxt = ids[i, start + 1:]
            lps = logp[i, start:width - 1].gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
            rows.append(([[int(t)] for t in nxt] + [[0]], [[float(x)] for x in lps] + [[0.0]]))
        return rows

    # -- the control calls verl makes on a server ----------------------------------------------------

    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False):
        return None

    async def resume_generation(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None


def _set(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)

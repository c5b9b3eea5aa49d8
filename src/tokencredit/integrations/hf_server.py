"""The server of the ``tc_hf`` rollout (:mod:`tokencredit.integrations.verl_cpu`): a causal LM that
generates with transformers ``generate`` behind verl's token-in, token-out server interface.

Kept apart from :mod:`.verl_cpu` and free of verl imports at module level: Ray imports this module
in the server's process by the class's reference, and a module that imported verl first would
load verl's plugins before the CPU platform is registered.
"""

from __future__ import annotations

import asyncio
import os

import torch

__all__ = ["HFRolloutServer"]


class HFRolloutServer:
    """One rollout replica's server: a causal LM generating with transformers ``generate``.

    Token in, token out (``generate(prompt_ids=..., sampling_params=...)`` -> verl's
    ``TokenOutput`` with the sampled tokens' log-probs). Requests that arrive together are
    generated as one left-padded batch. Weights arrive from the actor after each step
    (``load_weights``), through verl's weight-update path (``HFRolloutAdapter.update_weights``).
    """

    def __init__(self, model_path: str, dtype: str = "float32", max_batch: int = 64, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(max(1, int(os.environ.get("TC_HF_ROLLOUT_THREADS", "1"))))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=getattr(torch, dtype),
                                                          trust_remote_code=trust_remote_code)
        self.model.eval()
        tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos if eos is not None else tok.eos_token_id])
        self.max_batch = max_batch
        self.version = 0
        self.global_steps = 0  # the trainer step whose weights generate (verl reads it per output)
        self._queue: list = []
        self._lock = asyncio.Lock()

    # -- weights --------------------------------------------------------------------------------

    def load_weights(self, named_tensors, global_steps=None) -> int:
        state = dict(named_tensors)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
        if unexpected:
            raise ValueError(f"tc_hf rollout: weights for parameters the model does not have: {unexpected[:5]}")
        self.version += 1
        if global_steps is not None:
            self.global_steps = int(global_steps)
        return len(state)

    def weights_version(self) -> int:
        return self.version

    # -- generation -----------------------------------------------------------------------------

    async def generate(self, prompt_ids, sampling_params, request_id=None, image_data=None, video_data=None, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        fut = asyncio.get_running_loop().create_future()
        self._queue.append((list(prompt_ids), dict(sampling_params), fut))
        await asyncio.sleep(0)  # let the other requests of this wave enqueue
        async with self._lock:
            if not fut.done():
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
                self._run(batch)
        ids, lps = await fut
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    def _run(self, batch) -> None:
        # one generate call per distinct sampling setting; rows of one call share it
        by_params: dict = {}
        for item in batch:
            key = tuple(sorted((k, str(v)) for k, v in item[1].items()))
            by_params.setdefault(key, []).append(item)
        for items in by_params.values():
            try:
                results = self._generate([p for p, _, _ in items], items[0][1])
            except Exception as e:  # every waiting request gets the error, none hangs
                for _, _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, _, fut), r in zip(items, results):
                if not fut.done():
                    fut.set_result(r)

    @torch.no_grad()
    def _generate(self, prompts, params):
        B = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros(B, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        temperature = float(params.get("temperature", 1.0))
        max_new = int(params.get("max_tokens", params.get("max_new_tokens", 16)))
        greedy = temperature <= 0.0 or int(params.get("top_k", -1)) == 1
        gen_kwargs = dict(max_new_tokens=max_new, pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids),
                          output_scores=True, return_dict_in_generate=True)
        if greedy:
            gen_kwargs.update(do_sample=False)
        else:
            top_p = float(params.get("top_p", 1.0))
            top_k = int(params.get("top_k", -1))
            gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0)
        out = self.model.generate(input_ids=ids, attention_mask=attn, **gen_kwargs)
        seq = out.sequences[:, width:]
        # log-probs of the sampled tokens under the sampling distribution's logits at temperature
        # (verl's actor recomputes them at the rollout temperature; top-p/top-k are not applied here)
        logits = torch.stack(out.logits if getattr(out, "logits", None) else out.scores, dim=1).float()
        if not greedy:
            logits = logits / temperature if getattr(out, "logits", None) else logits
        lp = torch.log_softmax(logits, dim=-1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)
        results = []
        for i in range(B):
            toks = seq[i].tolist()
            n = len(toks)
            for j, t in enumerate(toks):
                if t in self.eos_ids:
                    n = j + 1
                    break
            results.append((toks[:n], [float(x) for x in lp[i, :n]]))
        return results

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

"""The continuation pass: Monte Carlo values of each step's prefix from fresh continuations.

A method that declares a :class:`~tokencredit.credit.registry.ContinuationPass` (VinePPO; SPO-chain, whose
cut rule reads the log-probs) has every response cut into steps by the declared rule,
and for each step ``s`` (up to ``max_steps``) ``k`` continuations are sampled from the current
policy after the prefix ``prompt + y_{<p_s}`` (``p_s`` the step's first token), each given the
response's remaining token budget, and scored by the task's reward on the whole response
``y_{<p_s} + continuation``:

    V_hat(h_{p_s}) = (1/k) sum_{j=1..k} R(y_{<p_s} + c_j),     c_j ~ pi_theta( . | x, y_{<p_s})

``mc_values[b, t]`` holds the value of the prefix before the step containing token t (0 for
the steps past ``max_steps``, which are not sampled), ``step_starts[b, t]`` is 1 on each step's
first token. Identical prefixes (the same prompt and response prefix) are sampled once.
Sampling uses the global torch RNG (the trainer's, seeded and checkpointed).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..credit.registry import ContinuationPass

__all__ = ["sample_continuations", "step_positions", "mc_step_values"]


@torch.no_grad()
def sample_continuations(model, prefixes: Sequence[Sequence[int]], k: int, budgets: Sequence[int], *, stop_ids: Sequence[int],
                         pad_id: int, temperature: float, top_p: float = 1.0) -> List[List[List[int]]]:
    """``out[i][j]``: the j-th of ``k`` continuations (token ids, cut after the first stop token,
    which is kept, and at ``budgets[i]`` tokens) sampled from ``model`` after ``prefixes[i]``."""
    from transformers import GenerationConfig

    from .rollout import response_mask_from_ids

    device = next(model.parameters()).device
    U, L = len(prefixes), max(len(p) for p in prefixes)
    ids = torch.full((U, L), int(pad_id), dtype=torch.long)
    att = torch.zeros((U, L), dtype=torch.long)
    for i, p in enumerate(prefixes):
        ids[i, L - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        att[i, L - len(p):] = 1
    rows = torch.arange(U).repeat_interleave(k)
    # every setting explicit: the samples come from softmax(logits / temperature) (top-p), nothing else
    gen = GenerationConfig(max_new_tokens=max(1, int(max(budgets))), do_sample=True, temperature=float(temperature),
                           top_p=float(top_p), top_k=0, repetition_penalty=1.0, eos_token_id=list(stop_ids),
                           pad_token_id=int(pad_id))
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=ids[rows].to(device), attention_mask=att[rows].to(device), generation_config=gen)
    finally:
        model.train(was_training)
    new = out[:, L:].cpu()
    keep = response_mask_from_ids(new, list(stop_ids)).bool()
    return [[new[i * k + j][keep[i * k + j]].tolist()[: int(budgets[i])] for j in range(k)] for i in range(U)]


def step_positions(plan: ContinuationPass, token_texts: Sequence[str], logprobs: Optional[torch.Tensor]) -> List[int]:
    """The declared cut rule's step starts for one response, checked: strictly increasing token
    positions, the first 0, all inside the response."""
    cuts = [int(p) for p in plan.cuts(list(token_texts), logprobs)]
    T = len(token_texts)
    if not cuts or cuts[0] != 0 or any(b <= a for a, b in zip(cuts, cuts[1:])) or cuts[-1] >= max(T, 1):
        raise ValueError(f"continuation cuts: expected strictly increasing token positions starting at 0 and below {T}, got {cuts[:8]}")
    return cuts


def mc_step_values(plan: ContinuationPass, *, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   decode: Callable[[List[int]], str], budget: int,
                   sample: Callable[[List[List[int]], int, List[int]], List[List[List[int]]]],
                   rewards: Callable[[int, List[List[int]]], Sequence[float]],
                   logprobs: Optional[torch.Tensor] = None, T: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """``{"mc_values", "step_starts"}`` ``[B, T]`` (float32) for a batch: ``prompts[b]`` and
    ``responses[b]`` (the valid response tokens) are row b's ids; ``sample(prefixes, k, budgets)``
    draws continuations (:func:`sample_continuations`); ``rewards(b, responses)`` scores whole
    responses to row b's prompt; ``budget`` is the response's token budget."""
    B = len(responses)
    T = T if T is not None else max((len(r) for r in responses), default=1)
    values = torch.zeros(B, T, dtype=torch.float32)
    starts = torch.zeros(B, T, dtype=torch.float32)
    wanted: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], List[Tuple[int, int, int]]] = {}  # prefix -> (row, step, t0)
    spans = []
    for b, resp in enumerate(responses):
        resp = [int(x) for x in resp]
        if not resp:
            spans.append([])
            continue
        lp = logprobs[b, : len(resp)] if logprobs is not None else None
        cuts = step_positions(plan, [decode([t]) for t in resp], lp)
        spans.append(list(zip(cuts, cuts[1:] + [len(resp)])))
        for s, p in enumerate(cuts):
            starts[b, p] = 1.0
            if plan.max_steps is None or s <= plan.max_steps:
                key = (tuple(int(x) for x in prompts[b]), tuple(resp[:p]))
                wanted.setdefault(key, []).append((b, s, p))
    keys = list(wanted)
    est: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], float] = {}
    if keys:
        budgets = [max(budget - len(pre), 0) for _, pre in keys]
        conts = sample([list(pr) + list(pre) for pr, pre in keys], plan.k, budgets)
        for key, cs in zip(keys, conts):
            b = wanted[key][0][0]
            r = [float(x) for x in rewards(b, [list(key[1]) + list(c) for c in cs])]
            est[key] = sum(r) / len(r)
    for key, uses in wanted.items():
        for b, s, p in uses:
            a, e = spans[b][s]
            values[b, a:e] = est[key]
    return {"mc_values": values, "step_starts": starts}

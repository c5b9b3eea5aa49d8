"""Teacher-forced forward passes over prompt + response, with each distinct prompt computed once.

GRPO-style batches hold K responses to every prompt, and the prompt is often as long as the
response. A causal model's states over the prompt do not depend on what follows, so the rows of
one prompt share them exactly: :func:`forward_response` runs the model once over the distinct
prompts (with grad, when grad is on), hands the resulting KV cache to each of their K rows
(``DynamicCache.batch_select_indices``, an index, so the gradient of the shared prompt states is
the sum over the K rows, as in the unshared pass), then runs only the responses. On the embedded
SmolLM2 with K = 4 this removes about three quarters of the prompt's forward and backward work
(``benchmarks/step_vs_trl.py --profile``).

Rows are right-padded to the batch's longest response, and a step's responses differ in length
(the README job's: 3-32 tokens, mean 11-24, a few at the 32-token budget). With ``buckets`` (the
default) the response pass runs the rows in groups of similar length, each cut to its own longest
row (:func:`length_buckets`), after the one shared prompt pass: the padding no longer costs a
forward and a backward. Positions past a bucket's length, which no real token reads, get logits
(and hidden states) 0; positions a row attends to are computed exactly as in the padded pass (up
to float rounding: a shorter matrix product may sum in another order).

The logits come from the model's own ``forward`` (``logits_to_keep`` selects the positions), so
whatever a model does after its head (Gemma-2's soft-capping, Granite's logit scaling) is kept.
"""

from __future__ import annotations

import copy
import math
from typing import List, Optional, Tuple

import torch

__all__ = ["base_model", "cache_name", "checkpointing_on", "forward_response", "distinct_rows", "length_buckets", "prompt_cache",
           "positions", "BUCKET_OVERHEAD"]

#: the cost of one more model call in a :func:`length_buckets` plan, in token positions. Measured on
#: SmolLM2-135M, fp32, 2 CPU threads: a forward + backward of 8 rows costs ~1.0 s at 2 response tokens
#: and ~2.2 s at 32 (~5 ms a position), and each extra call writes every weight's gradient once more;
#: on the README job's lengths 8, 32 and 100 timed alike (``benchmarks/update_buckets.py``, docs/performance.md)
BUCKET_OVERHEAD = 32


def base_model(model):
    """``model`` itself, or a peft model's base model (where its config and ``forward`` live)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_name(model) -> str:
    """The name of ``model``'s KV cache (its ``forward`` / ``generate`` keyword and its output's
    field): ``cache`` where transformers renamed it (there ``past_key_values`` is a deprecated
    alias that warns), else ``past_key_values``."""
    import inspect

    try:
        params = inspect.signature(base_model(model).forward).parameters
    except (TypeError, ValueError, AttributeError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def checkpointing_on(model) -> bool:
    """Whether ``model`` recomputes activations in backward (``is_activation_checkpointing``,
    ``is_gradient_checkpointing`` in older transformers, where the other is missing)."""
    base = base_model(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the new name first: the old one warns
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def distinct_rows(ids: torch.Tensor, mask: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(first, inverse)`` when some rows of ``(ids, mask)`` repeat, else None.

    ``first [U]`` indexes one row of each distinct (ids, mask) pair and ``inverse [N]`` maps every
    row to its pair: ``ids[first][inverse] == ids``.
    """
    n = ids.shape[0]
    if n < 2:
        return None
    key = torch.cat([ids, mask.to(ids.dtype)], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    u = uniq.shape[0]
    if u == n:
        return None
    # first occurrence of each distinct row: the smallest row index mapped to it
    first = torch.full((u,), n, dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(n, device=ids.device), reduce="amin")
    return first, inverse


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: a token's position counts the real tokens before it (as generate does)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def prompt_cache(model, ids: torch.Tensor, mask: torch.Tensor, first: torch.Tensor, inverse: torch.Tensor, *, hidden: bool = False):
    """Run the rows ``first`` of ``(ids, mask)`` once and index their KV cache out to the rows ``inverse``.

    Returns ``(out, cache)``: the model output over the distinct rows (logits of the last
    position only) and a cache with one row per entry of ``inverse``. The indexing is a gather,
    so under grad the shared states receive the sum of their rows' gradients.
    """
    p_ids, p_att = ids[first], mask[first]
    # the last position as an index tensor, not logits_to_keep=1: transformers' slice
    # hidden[:, -1:, :] is a strided view, and for a model whose weights do not require grad
    # (a frozen reference or teacher, a rollout's bf16 copy) torch.matmul then runs the LM head
    # as a bmm over the weight expanded to every row: a contiguous copy of rows x vocab x hidden
    # (1.8 GB for 32 prompts of SmolLM2 in bf16), which took most of a 128-row rollout's time.
    # An index gathers the rows into a contiguous tensor, and the head is one matmul.
    last = torch.tensor([p_ids.shape[1] - 1], device=p_ids.device)
    out = model(
        input_ids=p_ids, attention_mask=p_att, position_ids=positions(p_att),
        use_cache=True, logits_to_keep=last, output_hidden_states=hidden,
    )
    cache = getattr(out, cache_name(model))
    cache.batch_select_indices(inverse)
    return out, cache


def length_buckets(lengths, *, per_row: int = 0, overhead: int = BUCKET_OVERHEAD) -> List[List[int]]:
    """Rows grouped for a pass cut to each group's longest row: the row indices of each group.

    ``lengths[i]`` is row i's length; a group of n rows whose longest is m costs
    ``n * (per_row + m) + overhead`` (``per_row``: positions every row computes whatever its
    length). Over rows sorted by length, contiguous groups are optimal, and the cheapest split is a
    dynamic program over them. Groups come longest first, their rows in the input's order.
    """
    n = len(lengths)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (-int(lengths[i]), i))
    ls = [int(lengths[i]) for i in order]
    best = [0.0] + [math.inf] * n  # best[j]: the cheapest split of the j longest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group: sorted rows i..j-1, whose longest is ls[i]
            c = best[i] + (j - i) * (per_row + ls[i]) + overhead
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x [n, t, ...]`` with zeros appended along dim 1 up to ``length``."""
    if x.shape[1] == length:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], length - x.shape[1]) + tuple(x.shape[2:]))], dim=1)


def _regroup(parts, rows, length: int) -> torch.Tensor:
    """The per-group outputs ``parts`` (rows ``rows[g]`` of the batch) as one ``[n, length, ...]``
    tensor in the batch's row order (a gather: gradients flow to each part)."""
    allp = torch.cat([_pad_to(p, length) for p in parts], dim=0)
    if len(rows) == 1:  # one group holds every row, in order
        return allp
    order = torch.tensor([r for g in rows for r in g], device=allp.device)
    return allp[torch.argsort(order)]


def _select_cache(cache, idx: torch.Tensor):
    """A copy of DynamicCache ``cache`` holding rows ``idx`` (the tensors indexed, not copied in
    place: ``cache`` itself and the other groups' copies are untouched)."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    new.batch_select_indices(idx)
    return new


def response_lengths(attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``[N]`` each row's response length: one past its last attended response position (0: none)."""
    att = attention_mask[:, prompt_len:].bool()
    return (att * torch.arange(1, att.shape[1] + 1, device=att.device)).amax(dim=1)


def forward_response(model, input_ids, attention_mask, prompt_len: int, *, hidden: bool = False, share_prompts: bool = True,
                     buckets: bool = True):
    """Final hidden states and logits at the positions that predict response tokens.

    ``input_ids``/``attention_mask`` are ``[N, P + T]``: left-padded prompts, then right-padded
    responses (``prompt_len = P``). Returns ``(h, logits)``: ``h [N, T+1, D]`` the final hidden
    states before each response token and after the last one (None unless ``hidden``), and
    ``logits [N, T, V]`` whose row ``t`` is the distribution of response token ``t``.

    With ``share_prompts`` (the default) rows with identical prompts share one prompt pass, and
    with ``buckets`` (the default) the responses run in groups cut to their own length (see the
    module docstring); at every position a row attends to, the result equals the padded, unshared
    pass up to float rounding. Past a row's group's length, logits and hidden states are 0.
    """
    N, L = input_ids.shape
    P = int(prompt_len)
    T = L - P
    if not 1 <= P < L:
        raise ValueError(f"prompt_len: expected 1 <= prompt_len < {L} (input length), got {prompt_len}")
    groups = None
    if share_prompts and not checkpointing_on(model):
        # (gradient checkpointing turns the KV cache off in training, so nothing could be shared)
        groups = distinct_rows(input_ids[:, :P], attention_mask[:, :P])
    lengths = response_lengths(attention_mask, P).clamp_min(1).tolist() if buckets else [T] * N
    if groups is None:
        plan = length_buckets(lengths, per_row=P)
        if len(plan) == 1 and max(lengths) == T:  # nothing to cut: the padded pass itself
            return _full_pass(model, input_ids, attention_mask, P, hidden)
        return _in_groups(plan, lengths, T, hidden, input_ids.device,
                          lambda r, t: _full_pass(model, input_ids[r, : P + t], attention_mask[r, : P + t], P, hidden))

    first, inverse = groups
    # the prompt pass gives the logits (and state) at the last prompt position: response token 0
    po, cache = prompt_cache(model, input_ids[:, :P], attention_mask[:, :P], first, inverse, hidden=hidden)
    logits0 = po.logits[inverse]  # [N, 1, V]
    h0 = po.hidden_states[-1][:, -1:][inverse] if hidden else None
    if T == 1 and not hidden:
        return None, logits0
    n_prompt = attention_mask[:, :P].long().sum(-1)
    # (a cache without per-layer entries, such as a hybrid model's recurrent state, cannot be
    # copied per group: its rows stay one group, cut to the longest row)
    plan = length_buckets(lengths) if hasattr(cache, "layers") else [list(range(N))]
    if len(plan) == 1 and max(lengths) == T:  # one response pass over the padded rows
        return _response_pass(model, input_ids, attention_mask, P, T, n_prompt, cache, logits0, h0, hidden)

    def group(r, t):
        if t == 1 and not hidden:  # the prompt pass gave these rows' only logits
            return None, logits0[r]
        return _response_pass(model, input_ids[r, : P + t], attention_mask[r, : P + t], P, t, n_prompt[r],
                              cache if len(plan) == 1 else _select_cache(cache, r), logits0[r], h0[r] if hidden else None,
                              hidden)

    return _in_groups(plan, lengths, T, hidden, input_ids.device, group)


def _in_groups(plan, lengths, T: int, hidden: bool, device, run):
    """``run(rows, t)`` on each group of ``plan`` cut to its longest row ``t``, regrouped into the
    batch's ``(h [N, T+1, D] or None, logits [N, T, V])``."""
    hs, ls = [], []
    for rows in plan:
        h_g, l_g = run(torch.tensor(rows, device=device), max(lengths[i] for i in rows))
        hs.append(h_g)
        ls.append(l_g)
    return (_regroup(hs, plan, T + 1) if hidden else None), _regroup(ls, plan, T)


def _full_pass(model, input_ids, attention_mask, P: int, hidden: bool):
    """One forward over prompt + response: ``(h [n, T+1, D] or None, logits [n, T, V])``."""
    L = input_ids.shape[1]
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask),
        use_cache=False, logits_to_keep=torch.arange(P - 1, L - 1, device=input_ids.device),
        output_hidden_states=hidden,
    )
    h = out.hidden_states[-1][:, P - 1 :] if hidden else None
    return h, out.logits


def _response_pass(model, input_ids, attention_mask, P: int, T: int, n_prompt, cache, logits0, h0, hidden: bool):
    """The responses' pass over ``T`` positions on the prompts' ``cache``: ``(h, logits)`` with
    the prompt pass's last position (``logits0``, ``h0``) in front."""
    r_pos = n_prompt.unsqueeze(1) + torch.arange(T, device=input_ids.device)
    # response t predicts t+1: the logits of the last response token are not needed
    keep = torch.arange(T - 1, device=input_ids.device)
    ro = model(
        input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=r_pos,
        use_cache=True, logits_to_keep=keep, output_hidden_states=hidden, **{cache_name(model): cache},
    )
    logits = torch.cat([logits0, ro.logits], dim=1) if T > 1 else logits0
    h = torch.cat([h0, ro.hidden_states[-1]], dim=1) if hidden else None
    return h, logits

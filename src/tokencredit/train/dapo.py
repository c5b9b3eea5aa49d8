"""DAPO's reward-side pieces (Yu et al. 2025), as small pure functions.

Overlong reward shaping, for a response of length ``L``, budget ``L_max`` and cache ``C``::

    penalty(L) = min(-(L - (L_max - C)) / C * factor, 0)   if L > L_max - C
               = 0                                         otherwise

so it ramps linearly from 0 at ``L = L_max - C`` to ``-factor`` at ``L = L_max`` (and keeps
falling beyond, should a longer response ever reach it). It is *added* to the reward.

Dynamic sampling drops the groups whose rewards are all equal: such a group has zero
group-normalised advantage everywhere and so contributes no gradient. A singleton group (one
response) is kept, as verl's DAPO recipe keeps it (``recipe/dapo/dapo_ray_trainer.py``: a
prompt is kept when ``std > 0 or len(vals) == 1``; the later ``keep_mixed_reward`` filter also
"always keeps single samples"): verl's GRPO gives a singleton mean 0 and std 1, so its
advantage is its reward. ``keep_singletons=False`` drops them instead: tokencredit's group
estimators reject a singleton group (a CreditInputError), so a caller filtering for them should
drop singletons; the trainer never makes one (``rollout.samples_per_prompt >= 2``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..credit.batch import CreditInputError

__all__ = ["overlong_penalty", "dynamic_sampling_filter"]


def _vector(x, name: str) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.as_tensor(x)
    if t.dim() != 1:
        raise CreditInputError(f"{name}: expected a 1-D [B] tensor, got shape {tuple(t.shape)}")
    return t


def overlong_penalty(lengths, max_len: int, cache_len: int, *, factor: float = 1.0) -> Tensor:
    """Per-response penalty ``[B]`` (<= 0) from response lengths ``[B]``.

    ``factor`` is DAPO's ``overlong_penalty_factor`` (1.0 in the paper's recipe).
    """
    for name, v in (("max_len", max_len), ("cache_len", cache_len)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name}: expected a number > 0, got {v!r}")
    if cache_len > max_len:
        raise ValueError(f"cache_len: expected <= max_len ({max_len}), got {cache_len}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor >= 0):
        raise ValueError(f"factor: expected a number >= 0, got {factor!r}")
    L = _vector(lengths, "lengths")
    L = L.to(L.dtype if L.is_floating_point() else torch.float32)
    if not torch.isfinite(L).all() or (L < 0).any():
        raise CreditInputError(f"lengths: expected finite values >= 0, got {L.tolist()}")
    expected = max_len - cache_len
    pen = (-(L - expected) / cache_len * factor).clamp(max=0.0)
    return torch.where(L > expected, pen, torch.zeros_like(L))


def dynamic_sampling_filter(rewards, group_ids, *, keep_singletons: bool = True) -> Tensor:
    """Bool keep mask ``[B]``: True for responses of groups whose rewards are not all equal,
    and (``keep_singletons``, verl's DAPO recipe) of groups of one response."""
    if not isinstance(keep_singletons, bool):
        raise ValueError(f"keep_singletons: expected a bool, got {keep_singletons!r}")
    r = _vector(rewards, "rewards")
    g = _vector(group_ids, "group_ids")
    if r.shape != g.shape:
        raise CreditInputError(f"group_ids: expected shape {tuple(r.shape)} (the shape of rewards), got {tuple(g.shape)}")
    if not torch.isfinite(r.to(torch.float64)).all():
        raise CreditInputError(f"rewards: expected finite values, got {r.tolist()}")
    if r.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=r.device)
    _, inv = torch.unique(g, return_inverse=True)
    n = int(inv.max()) + 1
    r = r.to(torch.float64)
    hi = torch.full((n,), -math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((n,), math.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    keep = hi > lo
    if keep_singletons:
        keep |= torch.bincount(inv, minlength=n) == 1
    return keep[inv]

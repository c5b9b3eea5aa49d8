"""Small masked and grouped tensor operations shared by the methods.

Every reduction here reads only valid (mask = 1) positions, so padding never leaks into a
statistic and appending padding never changes a result.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .batch import CreditBatch, CreditInputError

__all__ = [
    "Groups",
    "groups_of",
    "group_mean",
    "group_std",
    "masked_fill_zero",
    "masked_sum",
    "masked_mean",
    "row_mean",
    "broadcast_to_tokens",
    "check_advantages",
]


class Groups(NamedTuple):
    index: Tensor  # [B] contiguous group index in [0, n)
    n: int
    counts: Tensor  # [n] responses per group


def groups_of(batch: CreditBatch, method: str, *, min_size: int = 2) -> Groups:
    """Contiguous group indices, rejecting singleton groups and groups with no valid token."""
    uniq, inv, counts = torch.unique(batch.group_ids, return_inverse=True, return_counts=True)
    small = counts < min_size
    if small.any():
        gid = uniq[small.nonzero()[0, 0]].item()
        raise CreditInputError(
            f"group_ids: method '{method}' needs groups of at least {min_size} responses, "
            f"got group {gid} with {int(counts[small][0])}"
        )
    tokens = torch.zeros(len(uniq), dtype=torch.long, device=inv.device).index_add_(0, inv, batch.mask.sum(1).long())
    empty = tokens == 0
    if empty.any():
        gid = uniq[empty.nonzero()[0, 0]].item()
        raise CreditInputError(
            f"response_mask: method '{method}' needs at least one valid token per group, got group {gid} with none"
        )
    return Groups(inv, len(uniq), counts)


def group_mean(x: Tensor, g: Groups) -> Tensor:
    """Mean of per-response values ``x [B]`` within each group, broadcast back to [B]."""
    s = torch.zeros(g.n, dtype=x.dtype, device=x.device).index_add_(0, g.index, x)
    return (s / g.counts.to(x.dtype))[g.index]


def group_std(x: Tensor, g: Groups, *, unbiased: bool = True) -> Tensor:
    """Standard deviation of ``x [B]`` within each group, broadcast back to [B]."""
    mu = group_mean(x, g)
    sq = torch.zeros(g.n, dtype=x.dtype, device=x.device).index_add_(0, g.index, (x - mu) ** 2)
    denom = g.counts.to(x.dtype) - (1.0 if unbiased else 0.0)
    return (sq / denom.clamp_min(1.0)).sqrt()[g.index]


def masked_fill_zero(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where mask, exactly 0 elsewhere (also where ``x`` is NaN at padding)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    x = masked_fill_zero(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Mean over valid positions; 0 where there are none (never NaN)."""
    n = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / n.clamp_min(1).to(x.dtype)


def row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Per-response mean over valid tokens, shape [B, 1] for broadcasting."""
    return masked_mean(x, mask, dim=1).unsqueeze(1)


def broadcast_to_tokens(adv_seq: Tensor, mask: Tensor) -> Tensor:
    """Uniform credit: a sequence advantage [B] on every valid token, 0 on padding."""
    return masked_fill_zero(adv_seq.unsqueeze(1).expand(mask.shape), mask)


def check_advantages(batch: CreditBatch, advantages: Tensor, method: str) -> None:
    """Calibrators receive [B, T] advantages from an estimator: check shape and finiteness."""
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) != tuple(batch.mask.shape):
        got = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise CreditInputError(
            f"advantages: method '{method}' expected shape {tuple(batch.mask.shape)}, got {got}"
        )
    bad = batch.mask & ~torch.isfinite(advantages)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CreditInputError(f"advantages: method '{method}' expected finite values on valid positions, got NaN/inf at {idx}")

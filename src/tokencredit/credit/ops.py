"""Small masked and grouped tensor operations shared by the methods.

Every reduction here reads only valid (mask = 1) positions, so padding never leaks into a
statistic and appending padding never changes a result.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

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
    "check_token_tensor",
    "stat_dtype",
    "weight_gini",
    "effective_token_ratio",
    "nonempty_row_mean",
    "sign_agreement",
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


# ---------------------------------------------------------------------------------------
# statistics of weights and credit, shared by methods (ARCA, OPPO) and diagnostics


def stat_dtype(x: Tensor) -> torch.dtype:
    """The dtype a statistic of ``x`` sums in: float64 (statistics sum over many tokens), float32
    on a device without it (MPS)."""
    return torch.float32 if x.device.type == "mps" else torch.float64


def check_token_tensor(x: Tensor, mask: Tensor, name: str) -> None:
    """Raise :class:`CreditInputError` (naming ``name``) unless ``x`` is a tensor of the mask's
    [B, T] shape."""
    if not isinstance(x, Tensor) or x.dim() != 2 or tuple(x.shape) != tuple(mask.shape):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise CreditInputError(f"{name}: expected shape {tuple(mask.shape)} (same as the mask), got {got}")


def _magnitudes(weights: Tensor, mask: Tensor) -> Tensor:
    """|w| in a wide dtype, 0 on padding, each row scaled by its max (both statistics are
    scale-invariant; the scaling keeps w^2 from overflowing or underflowing)."""
    check_token_tensor(weights, mask, "weights")
    mask = mask.bool()
    w = masked_fill_zero(weights.detach().to(stat_dtype(weights)).abs(), mask)
    top = w.amax(dim=1, keepdim=True)
    return torch.where(top > 0, w / torch.where(top > 0, top, torch.ones_like(top)), w)


def weight_gini(weights: Tensor, mask: Tensor) -> Tensor:
    """Per-trajectory Gini coefficient of |w| over valid tokens, shape [B].

    Uses the sorted form sum_j sum_k |x_j - x_k| = 2 sum_i (2 i - n - 1) x_(i) (x ascending,
    i = 1..n), which is O(n log n) time and O(n) memory instead of the n^2 pair table.
    Rows with no valid token or all-zero weights get 0.
    """
    mask = mask.bool()
    w = _magnitudes(weights, mask)
    B, T = w.shape
    n = mask.sum(dim=1)
    # padding sorts after every valid value, so the first n sorted entries are the row's tokens
    key = torch.where(mask, w, torch.full_like(w, math.inf))
    srt = key.sort(dim=1).values
    pos = torch.arange(T, device=w.device)
    in_row = pos.unsqueeze(0) < n.unsqueeze(1)
    srt = torch.where(in_row, srt, torch.zeros_like(srt))
    coef = (2 * (pos + 1)).unsqueeze(0) - n.unsqueeze(1) - 1
    num = (coef.to(w.dtype) * srt).sum(dim=1)
    total = srt.sum(dim=1)
    denom = n.to(w.dtype) * total
    g = torch.where(denom > 0, num / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(num))
    # round-off can leave a hair below 0 for near-uniform rows
    return g.clamp(min=0.0, max=1.0)


def effective_token_ratio(weights: Tensor, mask: Tensor) -> Tensor:
    """Per-trajectory effective-token ratio (sum w)^2 / (n sum w^2) of |w|, shape [B].

    In [1/n, 1]; rows with no valid token or all-zero weights get 1 (uniform).
    """
    mask = mask.bool()
    w = _magnitudes(weights, mask)
    n = mask.sum(dim=1).to(w.dtype)
    s1 = w.sum(dim=1)
    s2 = (w * w).sum(dim=1)
    denom = n * s2
    etr = torch.where(denom > 0, s1 * s1 / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.ones_like(s1))
    return etr.clamp(max=1.0)


def nonempty_row_mean(values: Tensor, mask: Tensor, empty: float = 0.0) -> float:
    """Mean of per-row ``values [B]`` over rows with at least one valid token (``empty`` if none)."""
    rows = mask.bool().any(dim=1)
    if not bool(rows.any()):
        return float(empty)
    return float(values[rows].to(stat_dtype(values)).mean())


def sign_agreement(advantages: Tensor, mask: Tensor, sequence_advantages: Optional[Tensor] = None) -> float:
    """Fraction of valid tokens with A_t != 0 whose sign equals the sign of their row's
    sequence advantage (given as [B], or the row sum of A if None).

    A row whose sequence advantage is 0 counts as disagreeing for each of its nonzero tokens.
    1.0 if no valid token has A_t != 0 (nothing disagrees).
    """
    check_token_tensor(advantages, mask, "advantages")
    mask = mask.bool()
    a = masked_fill_zero(advantages.detach().to(stat_dtype(advantages)), mask)
    if sequence_advantages is None:
        seq = a.sum(dim=1)
    else:
        B = mask.shape[0]
        if not isinstance(sequence_advantages, Tensor) or tuple(sequence_advantages.shape) != (B,):
            got = tuple(sequence_advantages.shape) if isinstance(sequence_advantages, Tensor) else type(sequence_advantages).__name__
            raise CreditInputError(f"sequence_advantages: expected shape ({B},), got {got}")
        seq = sequence_advantages.detach().to(a.dtype)
    nz = mask & (a != 0)
    n = int(nz.sum())
    if n == 0:
        return 1.0
    agree = nz & (torch.sign(a) == torch.sign(seq).unsqueeze(1))
    return int(agree.sum()) / n

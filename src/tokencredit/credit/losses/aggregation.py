"""Aggregation of a per-token loss matrix ``[B, T]`` into the scalar the optimiser sees.

With ``x`` the loss on valid tokens (padding is never read), ``n_b`` the number of valid
tokens of row b and ``R = {b : n_b > 0}`` the non-empty rows::

    token-mean               sum_{b,t} x / sum_b n_b                       (DAPO; verl default)
    token-sum                sum_{b,t} x
    seq-mean-token-mean      mean_{b in R} ( sum_t x_b / n_b )             (GRPO paper, SAPO)
    seq-mean-token-sum       mean_{b in R} ( sum_t x_b )
    seq-mean-token-sum-norm  mean_{b in R} ( sum_t x_b / C )               (Dr. GRPO)

``C`` is ``norm_constant``, by default the padded length ``T`` (as verl). Dr. GRPO wants ``C``
constant over training; ``T`` is not (it is the longest response of the batch), so pass a fixed
``norm_constant`` (e.g. the generation budget) to reproduce the paper.

Rows with no valid token are excluded from every ``seq-mean`` (they count neither in the sum
nor in the number of sequences), so appending an empty row changes nothing. A batch with no
valid token at all aggregates to exactly 0 (still attached to the graph, gradient 0).

Differences from verl's ``agg_loss`` (documented in docs/parts/losses.md): verl's
``seq-mean-token-sum-norm`` divides the *batch* sum by ``T`` without averaging over sequences,
i.e. it is ``|R|`` times the value here; the mean over sequences is the paper's ``1/G`` and
keeps the scale of the loss independent of the batch size, like the other ``seq-mean`` modes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..batch import CreditInputError
from ._inputs import as_mask

__all__ = ["AGG_MODES", "aggregate", "check_agg_mode"]

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def check_agg_mode(mode, norm_constant=None, *, field: str = "agg_mode") -> None:
    """ValueError naming ``field`` for an unknown mode or a bad/misplaced ``norm_constant``."""
    if mode not in AGG_MODES:
        raise ValueError(f"{field}: expected one of {list(AGG_MODES)}, got {mode!r}")
    if norm_constant is not None:
        if mode != "seq-mean-token-sum-norm":
            raise ValueError(
                f"norm_constant: only used by agg mode 'seq-mean-token-sum-norm', got it with {mode!r}"
            )
        if isinstance(norm_constant, bool) or not isinstance(norm_constant, (int, float)) or not (
            math.isfinite(norm_constant) and norm_constant > 0
        ):
            raise ValueError(f"norm_constant: expected a finite number > 0, got {norm_constant!r}")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str, *, norm_constant: Optional[float] = None) -> Tensor:
    """Scalar loss from ``loss_mat [B, T]`` over the valid positions of ``mask [B, T]``."""
    check_agg_mode(mode, norm_constant)
    if not isinstance(loss_mat, Tensor) or loss_mat.dim() != 2:
        got = tuple(loss_mat.shape) if isinstance(loss_mat, Tensor) else type(loss_mat).__name__
        raise CreditInputError(f"loss_mat: expected a 2-D [B, T] tensor, got {got}")
    m = as_mask(mask, loss_mat.shape, field="mask")
    # where, not multiply: NaN at padding must not reach the value or the gradient
    x = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    n_tok = m.sum(1)
    if mode == "token-sum":
        return x.sum()
    if mode == "token-mean":
        return x.sum() / n_tok.sum().clamp_min(1).to(x.dtype)
    row_sum = x.sum(1)
    n_rows = (n_tok > 0).sum().clamp_min(1).to(x.dtype)
    if mode == "seq-mean-token-mean":
        per_row = row_sum / n_tok.clamp_min(1).to(x.dtype)  # empty rows: 0 / 1 = 0, and not counted
    elif mode == "seq-mean-token-sum":
        per_row = row_sum
    else:  # seq-mean-token-sum-norm
        c = float(norm_constant) if norm_constant is not None else float(max(loss_mat.shape[1], 1))
        per_row = row_sum / c
    return per_row.sum() / n_rows

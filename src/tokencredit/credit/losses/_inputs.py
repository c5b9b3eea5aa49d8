"""Input checks shared by the losses (private).

Every loss reads ``[B, T]`` tensors plus a response mask. Padding may hold anything (NaN
included): :func:`clean` replaces it with 0 through ``torch.where`` *before* any arithmetic,
so neither the value nor the gradient of a loss can see it (``0 * NaN`` in a backward pass
would otherwise poison the gradient of the padded positions).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..batch import CreditInputError


def as_mask(response_mask, shape=None, *, field: str = "response_mask") -> Tensor:
    """The mask as bool [B, T]; numeric masks must hold only 0 and 1."""
    if not isinstance(response_mask, Tensor):
        raise CreditInputError(f"{field}: expected a [B, T] tensor, got {type(response_mask).__name__}")
    if response_mask.dim() != 2:
        raise CreditInputError(f"{field}: expected a 2-D [B, T] tensor, got shape {tuple(response_mask.shape)}")
    if shape is not None and tuple(response_mask.shape) != tuple(shape):
        raise CreditInputError(f"{field}: expected shape {tuple(shape)}, got {tuple(response_mask.shape)}")
    if response_mask.dtype == torch.bool:
        return response_mask
    bad = (response_mask != 0) & (response_mask != 1)
    if bad.any():
        raise CreditInputError(f"{field}: expected only 0/1 values, got {response_mask[bad][0].item()!r}")
    return response_mask != 0


def check_tensor(x, name: str, shape, ref_name: str) -> Tensor:
    """``x`` must be a tensor of exactly ``shape`` (the shape of ``ref_name``)."""
    if not isinstance(x, Tensor):
        raise CreditInputError(f"{name}: expected a tensor of shape {tuple(shape)} like {ref_name}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise CreditInputError(
            f"{name}: expected shape {tuple(shape)} (the shape of {ref_name}), got {tuple(x.shape)}"
        )
    return x


def check_finite(x: Tensor, mask: Tensor, name: str) -> None:
    """Non-finite values are allowed at padding only."""
    bad = mask & ~torch.isfinite(x.detach())
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CreditInputError(f"{name}: expected finite values on valid positions, got {x[idx].item()} at {idx}")


def compute_dtype(x: Tensor) -> torch.dtype:
    # ratios exp(l - l_old) lose too much in bf16/fp16: compute in at least float32
    return x.dtype if x.dtype == torch.float64 else torch.float32


def clean(x: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` as ``dtype`` on valid positions, exactly 0 (no gradient path) on padding."""
    x = x.to(dtype)
    return torch.where(mask, x, torch.zeros((), dtype=dtype, device=x.device))


def check_pair(logprobs, other, other_name: str, response_mask=None) -> Optional[Tensor]:
    """Validate ``logprobs`` and one more [B, T] tensor (and an optional mask)."""
    if not isinstance(logprobs, Tensor) or logprobs.dim() != 2:
        got = tuple(logprobs.shape) if isinstance(logprobs, Tensor) else type(logprobs).__name__
        raise CreditInputError(f"logprobs: expected a 2-D [B, T] tensor, got {got}")
    check_tensor(other, other_name, logprobs.shape, "logprobs")
    if response_mask is None:
        return None
    return as_mask(response_mask, logprobs.shape)

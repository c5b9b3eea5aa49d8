"""KL penalty to a reference policy, per token, from sampled-token log-probs.

With ``d = l - l_ref`` (current minus reference log-prob of the sampled token)::

    k1  d                                         unbiased for KL(pi || ref), high variance, can be < 0
    k2  0.5 d^2                                   biased; its gradient is the KL gradient on-policy
    k3  exp(-d) - (-d) - 1 = exp(l_ref - l) - (l_ref - l) - 1
                                                  Schulman's low-variance unbiased estimator, >= 0

k3 follows verl's ``low_var_kl``: ``l_ref - l`` is clamped to ``[-log_ratio_clamp,
log_ratio_clamp]`` (20) before the exponential and the result to ``[-k3_clamp, k3_clamp]`` (10),
so a token far from the reference contributes at most 10 and no gradient beyond that.

:func:`add_kl_penalty` adds ``beta * aggregate(kl, mask, agg_mode)`` to a policy loss.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ._inputs import check_finite, check_pair, clean, compute_dtype
from .aggregation import aggregate

__all__ = ["KL_KINDS", "kl_penalty", "add_kl_penalty"]

KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kind: str = "k3",
    response_mask: Optional[Tensor] = None,
    *,
    log_ratio_clamp: float = 20.0,  # verl low_var_kl: clamp before exp for stability
    k3_clamp: float = 10.0,  # verl low_var_kl: clamp of the estimate
) -> Tensor:
    """Per-token KL estimate ``[B, T]`` (differentiable in ``logprobs``).

    With ``response_mask`` the output is exactly 0 at padding and padding is never read (it may
    hold NaN); without it every position is treated as valid and must be finite.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind: expected one of {list(KL_KINDS)}, got {kind!r}")
    for name, v in (("log_ratio_clamp", log_ratio_clamp), ("k3_clamp", k3_clamp)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}: expected a finite number > 0, got {v!r}")
    mask = check_pair(logprobs, ref_logprobs, "ref_logprobs", response_mask)
    if mask is None:
        mask = torch.ones(logprobs.shape, dtype=torch.bool, device=logprobs.device)
    check_finite(logprobs, mask, "logprobs")
    check_finite(ref_logprobs, mask, "ref_logprobs")
    dt = compute_dtype(logprobs)
    lp = clean(logprobs, mask, dt)
    ref = clean(ref_logprobs.detach(), mask, dt)
    if kind == "k1":
        out = lp - ref
    elif kind == "k2":
        out = 0.5 * (lp - ref) ** 2
    else:
        neg = (ref - lp).clamp(-log_ratio_clamp, log_ratio_clamp)
        out = (neg.exp() - neg - 1.0).clamp(-k3_clamp, k3_clamp)
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def add_kl_penalty(
    loss: Tensor,
    logprobs: Tensor,
    ref_logprobs: Optional[Tensor],
    response_mask: Tensor,
    *,
    beta: float,
    kind: str = "k3",
    agg_mode: str = "token-mean",
    norm_constant: Optional[float] = None,
) -> Tuple[Tensor, Dict[str, float]]:
    """``loss + beta * aggregate(kl_penalty(...), mask, agg_mode)`` and ``{"kl/value", "kl/coef"}``.

    ``beta = 0`` returns ``loss`` unchanged (``ref_logprobs`` may then be None).
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta: expected a finite number >= 0, got {beta!r}")
    if beta == 0 and ref_logprobs is None:
        return loss, {}
    if ref_logprobs is None:
        raise ValueError(f"ref_logprobs: required when beta > 0 (beta={beta}), got None")
    kl = aggregate(kl_penalty(logprobs, ref_logprobs, kind, response_mask), response_mask, agg_mode,
                   norm_constant=norm_constant)
    metrics = {"kl/value": float(kl.detach()), "kl/coef": float(beta)}
    if beta == 0:
        return loss, metrics
    return loss + beta * kl, metrics

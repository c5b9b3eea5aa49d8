"""Credit diagnostics: how concentrated, how signed and where credit lands, for any method.

Every function takes ``[B, T]`` tensors and the response mask, reads valid positions only
(so appending padding never changes a result) and never returns NaN.

Concentration of a trajectory's n valid weights w (ARCA's diagnostics):

    Gini  G   = sum_j sum_k |w_j - w_k| / (2 n^2 mean w)      in [0, (n - 1) / n]
    ETR       = (sum w)^2 / (n sum w^2)                       in [1 / n, 1]

G = 0 and ETR = 1 for uniform weights; G = (n - 1)/n and ETR = 1/n for one token holding all
of it. Both are computed per trajectory and then averaged over trajectories with at least one
valid token. A trajectory whose weights are all 0 has no concentration to measure: it is
treated as uniform (G = 0, ETR = 1), never NaN. Weights are taken by magnitude |w|.

:func:`credit_diagnostics` is the one entry point the trainer calls on every method's output;
it returns flat ``"diag/..."`` metrics.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

from .batch import CreditBatch, CreditInputError
from .ops import (
    check_advantages,
    check_token_tensor,
    effective_token_ratio,
    masked_fill_zero,
    nonempty_row_mean,
    sign_agreement,
    stat_dtype,
    weight_gini,
)
from .registry import CreditOutput

__all__ = [
    "weight_gini",
    "effective_token_ratio",
    "nonempty_row_mean",
    "entropy_stats",
    "quadrant_fractions",
    "tail_token_fraction",
    "credit_mass",
    "sign_agreement",
    "credit_diagnostics",
]

#: percentiles reported by :func:`entropy_stats` by default
DEFAULT_PERCENTILES = (0.1, 0.5, 0.9)
#: TACO's default tail level alpha (reference code), used for the tail-token fraction
DEFAULT_TAIL_ALPHA = 0.01


def _sorted_quantiles(srt: Tensor, qs: Sequence[float]) -> list:
    # linear interpolation between order statistics, as torch.quantile / numpy "linear";
    # done by hand because torch.quantile refuses inputs above 2^24 elements
    n = srt.numel()
    out = []
    for q in qs:
        p = q * (n - 1)
        lo = int(math.floor(p))
        hi = min(lo + 1, n - 1)
        frac = p - lo
        out.append(float(srt[lo] + (srt[hi] - srt[lo]) * frac))
    return out


def entropy_stats(entropy: Tensor, mask: Tensor, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Dict[str, float]:
    """Mean, population std and percentiles of the entropy over all valid tokens of the batch.

    Keys ``mean``, ``std`` and ``p10``-style names (``p50`` for 0.5). All 0 with no valid token.
    """
    check_token_tensor(entropy, mask, "entropy")
    for q in percentiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"percentiles: expected values in [0, 1], got {q}")
    keys = [f"p{q * 100:g}" for q in percentiles]
    x = entropy.detach()[mask.bool()].to(stat_dtype(entropy))
    if x.numel() == 0:
        return {"mean": 0.0, "std": 0.0, **{k: 0.0 for k in keys}}
    out = {"mean": float(x.mean()), "std": float(x.std(unbiased=False))}
    out.update(zip(keys, _sorted_quantiles(x.sort().values, percentiles)))
    return out


def quadrant_fractions(advantages: Tensor, surprisal: Tensor, mask: Tensor) -> Dict[str, float]:
    """STARE's advantage-surprisal quadrants over valid tokens with A != 0.

    "high" means surprisal strictly above the batch median of valid-token surprisal (the lower
    median, as torch.median, taken over every valid token), "low" at or below it. Returns
    fractions ``pos_high, pos_low, neg_high, neg_low`` summing to 1; all 0 if no valid token
    has A != 0.
    """
    check_token_tensor(advantages, mask, "advantages")
    check_token_tensor(surprisal, mask, "surprisal")
    mask = mask.bool()
    keys = ("pos_high", "pos_low", "neg_high", "neg_low")
    if not bool(mask.any()):
        return {k: 0.0 for k in keys}
    s = surprisal.detach()
    med = s[mask].median()
    a = advantages.detach()
    high = s > med
    pos = mask & (a > 0)
    neg = mask & (a < 0)
    n = int((pos | neg).sum())
    if n == 0:
        return {k: 0.0 for k in keys}
    counts = ((pos & high).sum(), (pos & ~high).sum(), (neg & high).sum(), (neg & ~high).sum())
    return {k: int(c) / n for k, c in zip(keys, counts)}


def tail_token_fraction(logprobs: Tensor, entropy: Tensor, mask: Tensor, alpha: float = DEFAULT_TAIL_ALPHA) -> float:
    """Fraction of valid tokens in TACO's tail: r_t = -l_t - H_t + log(alpha) > 0."""
    if not alpha > 0:
        raise ValueError(f"alpha: expected > 0, got {alpha}")
    check_token_tensor(logprobs, mask, "logprobs")
    check_token_tensor(entropy, mask, "entropy")
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0:
        return 0.0
    dt = stat_dtype(logprobs)
    r = -logprobs.detach().to(dt) - entropy.detach().to(dt) + math.log(alpha)
    return int((mask & (r > 0)).sum()) / n


def credit_mass(advantages: Tensor, mask: Tensor) -> Dict[str, float]:
    """Positive and negative credit mass over valid tokens, total and per valid token.

    ``pos`` = sum of A over A > 0 (>= 0), ``neg`` = sum of A over A < 0 (<= 0);
    ``pos_per_token`` / ``neg_per_token`` divide by the number of valid tokens.
    """
    check_token_tensor(advantages, mask, "advantages")
    mask = mask.bool()
    a = masked_fill_zero(advantages.detach().to(stat_dtype(advantages)), mask)
    pos = float(a.clamp(min=0).sum())
    neg = float(a.clamp(max=0).sum())
    n = max(int(mask.sum()), 1)
    return {"pos": pos, "neg": neg, "pos_per_token": pos / n, "neg_per_token": neg / n}


def credit_diagnostics(
    batch: CreditBatch,
    output: CreditOutput,
    sequence_advantages: Optional[Tensor] = None,
    *,
    tail_alpha: float = DEFAULT_TAIL_ALPHA,
) -> Dict[str, float]:
    """Flat ``"diag/..."`` metrics for any method's :class:`CreditOutput` on ``batch``.

    Concentration (Gini, ETR) is measured on ``output.token_weights`` when the method reports
    weights, otherwise on |advantages|: then it is the concentration of the credit magnitude
    (uniform GRPO credit gives G = 0, ETR = 1). ``diag/weights_from_token_weights`` says which
    (1.0 or 0.0). Signal-dependent metrics appear only when the batch carries the signal:
    quadrants need logprobs, the tail fraction logprobs and entropy, entropy stats entropy.
    """
    if not isinstance(batch, CreditBatch):
        raise TypeError(f"batch: expected a CreditBatch, got {type(batch).__name__}")
    mask = batch.mask
    check_advantages(batch, output.advantages, "credit_diagnostics")
    adv = masked_fill_zero(output.advantages.detach(), mask)
    if output.token_weights is not None:
        w = output.token_weights
        check_token_tensor(w, mask, "token_weights")
        if bool((mask & ~torch.isfinite(w)).any()):
            raise CreditInputError("token_weights: expected finite values on valid positions, got NaN/inf")
        from_weights = 1.0
    else:
        w = adv.abs()
        from_weights = 0.0

    m: Dict[str, float] = {
        "diag/weights_from_token_weights": from_weights,
        "diag/weight_gini": nonempty_row_mean(weight_gini(w, mask), mask, empty=0.0),
        "diag/weight_etr": nonempty_row_mean(effective_token_ratio(w, mask), mask, empty=1.0),
    }
    for k, v in credit_mass(adv, mask).items():
        m[f"diag/credit_{k}"] = v
    m["diag/sign_agreement"] = sign_agreement(adv, mask, sequence_advantages)
    if batch.logprobs is not None:
        for k, v in quadrant_fractions(adv, -batch.logprobs, mask).items():
            m[f"diag/quadrant_{k}"] = v
        if batch.entropy is not None:
            m["diag/tail_token_frac"] = tail_token_fraction(batch.logprobs, batch.entropy, mask, tail_alpha)
    if batch.entropy is not None:
        for k, v in entropy_stats(batch.entropy, mask).items():
            m[f"diag/entropy_{k}"] = v
    return m

"""ARCA (Adapter-Residual Credit Assignment): credit where the LoRA adapter changes the model.

    s_t  = || h_adapted_t - h_base_t ||_2      final hidden state before the LM head, adapter
                                               on vs off on the same tokens (the trainer's job)
    w_t  = s_t / mean_traj(s)                  mean 1 over the trajectory's valid tokens
    w_t  = (1 - kappa) + kappa * w_t           mix with uniform credit (kappa = 1: pure salience)
    w_t  = clip(w_t, 0, w_max)
    A'_t = w_t * A_t                           on every token, whatever the sign of A

If every residual of a trajectory is 0 (a fresh LoRA, whose B matrix is 0) the weights are
uniform (w = 1), never NaN. Without clipping the weights have mean exactly 1 per trajectory,
so the trajectory's total credit is that of the estimator; a binding w_max lowers it.

Provenance: the salience s_t is the paper's; the weighting (normalise to mean 1, mix, clip)
is a **reconstruction** from the abstract's claims (docs/methods.md, section ARCA). The same
weighting serves ARCA's intrinsic baselines (``intrinsic.py``) through
:func:`normalize_salience`, so the comparison changes only the salience.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch
from torch import Tensor

from ..batch import CreditBatch, CreditInputError
from ..diagnostics import effective_token_ratio, nonempty_row_mean, weight_gini
from ..ops import check_advantages, masked_fill_zero, masked_sum, row_mean
from ..registry import CreditOutput, register_calibrator

__all__ = ["ARCAConfig", "arca", "normalize_salience", "weighting_metrics", "DEFAULT_KAPPA", "DEFAULT_W_MAX"]

# reconstructed (docs/methods.md): pure salience weights; kappa < 1 interpolates toward uniform credit
DEFAULT_KAPPA = 1.0
# reconstructed: serves the claim of a non-degenerate middle regime. Capping a token at 5x the
# trajectory's mean credit keeps salience from piling the credit onto a few positions (the
# concentrated degenerate regime, ETR -> 1/n) while leaving typical salience ratios untouched.
DEFAULT_W_MAX = 5.0


def check_weighting(method: str, kappa: float, w_max: float) -> None:
    """Validate the mixing and clipping parameters (ValueError naming the field)."""
    if not (isinstance(kappa, (int, float)) and 0.0 <= kappa <= 1.0):
        raise ValueError(f"{method} kappa: expected a number in [0, 1], got {kappa!r}")
    # w_max < 1 would clip even uniform weights below 1; math.inf disables clipping
    if not (isinstance(w_max, (int, float)) and w_max >= 1.0):
        raise ValueError(f"{method} w_max: expected a number >= 1 (math.inf for no clipping), got {w_max!r}")


def normalize_salience(
    salience: Tensor, mask: Tensor, kappa: float = DEFAULT_KAPPA, w_max: float = DEFAULT_W_MAX
) -> Tensor:
    """Per-token credit weights from a non-negative salience [B, T].

    ``w = clip((1 - kappa) + kappa * s / mean_traj(s), 0, w_max)`` on valid tokens, 0 on padding.
    A trajectory whose salience is all 0 gets w = 1 on every valid token. Raises
    :class:`CreditInputError` for a negative or non-finite salience on a valid token.
    """
    check_weighting("normalize_salience", kappa, w_max)
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise CreditInputError(f"mask: expected a [B, T] tensor, got {mask!r}"[:200])
    if not isinstance(salience, Tensor) or tuple(salience.shape) != tuple(mask.shape):
        got = tuple(salience.shape) if isinstance(salience, Tensor) else type(salience).__name__
        raise CreditInputError(f"salience: expected shape {tuple(mask.shape)}, got {got}")
    mask = mask.bool()
    s = salience.detach()
    bad = mask & ~(torch.isfinite(s) & (s >= 0))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CreditInputError(f"salience: expected finite values >= 0 on valid tokens, got {s[idx].item()} at {idx}")
    s = masked_fill_zero(s, mask)
    mean = row_mean(s, mask)
    live = mean > 0
    w = torch.where(live, s / torch.where(live, mean, torch.ones_like(mean)), torch.ones_like(s))
    w = (1.0 - kappa) + kappa * w
    w = w.clamp(min=0.0, max=w_max) if math.isfinite(w_max) else w.clamp(min=0.0)
    return masked_fill_zero(w, mask)


def weighting_metrics(method: str, weights: Tensor, salience: Tensor, mask: Tensor, zero_key: str) -> Dict[str, float]:
    """ARCA's concentration metrics of salience weights, namespaced ``method/...``.

    gini and etr: per-trajectory weight Gini and effective-token ratio, averaged over non-empty
    trajectories; weight_max_mean: mean of each trajectory's largest weight; ``zero_key``: the
    fraction of non-empty trajectories whose salience is all 0 (the uniform fallback).
    """
    mask = mask.bool()
    nonempty = mask.any(dim=1)
    w_max_row = torch.where(mask, weights, torch.zeros_like(weights)).amax(dim=1)
    s = salience.detach()
    dead = nonempty & (masked_sum(s.abs(), mask, dim=1) == 0)
    n_rows = int(nonempty.sum())
    return {
        f"{method}/gini": nonempty_row_mean(weight_gini(weights, mask), mask, empty=0.0),
        f"{method}/etr": nonempty_row_mean(effective_token_ratio(weights, mask), mask, empty=1.0),
        f"{method}/weight_max_mean": nonempty_row_mean(w_max_row, mask, empty=0.0),
        f"{method}/{zero_key}": int(dead.sum()) / n_rows if n_rows else 0.0,
    }


@dataclass
class ARCAConfig:
    kappa: float = DEFAULT_KAPPA  # reconstructed (docs/methods.md): 1.0 = pure residual salience
    w_max: float = DEFAULT_W_MAX  # reconstructed: caps one token at 5x mean credit (middle-regime claim)

    def __post_init__(self):
        check_weighting("arca", self.kappa, self.w_max)


@register_calibrator(
    "arca",
    config=ARCAConfig,
    requires=("hidden_residual",),
    provenance="reconstructed",
    summary="token weights from the LoRA adapter's hidden-state residual, mean 1 per trajectory",
    paired_with="grpo",
)
def arca(batch: CreditBatch, advantages: Tensor, config: ARCAConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "arca")
    batch.require("arca", ["hidden_residual"])
    w = normalize_salience(batch.hidden_residual, batch.mask, config.kappa, config.w_max)
    adv = masked_fill_zero(w.to(advantages.dtype) * advantages.detach(), batch.mask)
    return CreditOutput(
        advantages=adv,
        token_weights=w,
        metrics=weighting_metrics("arca", w, batch.hidden_residual, batch.mask, "zero_residual_frac"),
    )

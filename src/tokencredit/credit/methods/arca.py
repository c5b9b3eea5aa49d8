"""ARCA (Adapter-Residual Credit Assignment): credit where the LoRA adapter changes the model.

    alpha_t = || h_adapted_t - h_base_t ||_2       final hidden state before the LM head, adapter
                                                   on vs off on the same tokens (the trainer's job)
    a_t     = (alpha_t + eps) ** sharpening        eps floor, then the optional sharpening power
    p_t     = a_t / sum_traj(a)                    the paper's weights: sum 1 per trajectory
    w_t     = n * p_t = a_t / mean_traj(a)         tokencredit's multiplier: mean 1 per trajectory
    w_t     = (1 - kappa) + kappa * w_t            optional mix with uniform credit (off: kappa = 1)
    w_t     = clip(w_t, 0, w_max)                  optional clip (off: w_max = inf)
    A'_t    = w_t * A_t                            on every token, whatever the sign of A

The paper's update is ``A * sum_t p_t grad log pi(y_t)``. tokencredit carries the weights as
factors on the advantages, ``w = n p`` (n the trajectory's valid tokens), so under
seq-mean-token-mean aggregation ``(1/n) sum_t w_t A grad log pi = A sum_t p_t grad log pi``:
the same update (``--credit arca`` selects that aggregation; tests/test_arca.py checks the
gradient against the reference's loss formula). At the defaults (no mix, no clip) this is the
authors' code (rodlaf/tokenweighting, ``experiment/hf/token_weights.py``).

A trajectory whose scores all vanish next to eps gets uniform weights (w = 1), as the paper
says of its floor; with ``eps = 0`` an all-zero trajectory falls back to uniform explicitly.
The same weighting serves ARCA's intrinsic baselines (``intrinsic.py``) through
:func:`normalize_salience`, so the comparison changes only the salience.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch
from torch import Tensor

from ..batch import CreditBatch, CreditInputError
from ..ops import effective_token_ratio, nonempty_row_mean, weight_gini
from ..ops import check_advantages, masked_fill_zero, masked_sum, row_mean
from ..registry import CreditOutput, register_calibrator

__all__ = [
    "ARCAConfig", "arca", "normalize_salience", "weighting_metrics",
    "DEFAULT_EPS", "DEFAULT_SHARPENING", "DEFAULT_KAPPA", "DEFAULT_W_MAX",
]

# ref-code: TokenWeightingConfig.eps = 1e-8, added to every score before normalising
DEFAULT_EPS = 1e-8
# ref-code: TokenWeightingConfig.sharpening = 1.0 (its MATH experiment configs set 2.0)
DEFAULT_SHARPENING = 1.0
# ref-code: no mixing with uniform credit (kappa = 1 keeps the pure salience weights)
DEFAULT_KAPPA = 1.0
# ref-code: no clipping
DEFAULT_W_MAX = math.inf


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def check_weighting(method: str, eps: float, sharpening: float, kappa: float, w_max: float) -> None:
    """Validate the weighting parameters (ValueError naming the field, expected and actual)."""
    if not (_is_number(eps) and math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"{method} eps: expected a finite number >= 0, got {eps!r}")
    if not (_is_number(sharpening) and math.isfinite(sharpening) and sharpening >= 0.0):
        raise ValueError(f"{method} sharpening: expected a finite number >= 0, got {sharpening!r}")
    if not (_is_number(kappa) and 0.0 <= kappa <= 1.0):
        raise ValueError(f"{method} kappa: expected a number in [0, 1], got {kappa!r}")
    # w_max < 1 would clip even uniform weights below 1; math.inf disables clipping
    if not (_is_number(w_max) and w_max >= 1.0):
        raise ValueError(f"{method} w_max: expected a number >= 1 (math.inf for no clipping), got {w_max!r}")


def normalize_salience(
    salience: Tensor,
    mask: Tensor,
    *,
    eps: float = DEFAULT_EPS,
    sharpening: float = DEFAULT_SHARPENING,
    kappa: float = DEFAULT_KAPPA,
    w_max: float = DEFAULT_W_MAX,
) -> Tensor:
    """Mean-1 per-token credit weights from a non-negative salience [B, T].

    ``w = clip((1 - kappa) + kappa * n (s + eps)^p / sum_traj (s + eps)^p, 0, w_max)`` on valid
    tokens (n valid tokens, p = ``sharpening``), 0 on padding; ``w / n`` at the defaults is the
    reference's sum-1 weight. A trajectory whose salience is all 0 gets w = 1 on every valid
    token. Raises :class:`CreditInputError` for a negative or non-finite salience on a valid
    token.
    """
    check_weighting("normalize_salience", eps, sharpening, kappa, w_max)
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise CreditInputError(f"mask: expected a [B, T] tensor, got {mask!r}"[:200])
    if not isinstance(salience, Tensor) or tuple(salience.shape) != tuple(mask.shape):
        got = tuple(salience.shape) if isinstance(salience, Tensor) else type(salience).__name__
        raise CreditInputError(f"salience: expected shape {tuple(mask.shape)}, got {got}")
    mask = mask.bool()
    s = salience.detach()
    if not s.is_floating_point() or s.dtype in (torch.float16, torch.bfloat16):
        s = s.float()  # as the reference (.float()): eps = 1e-8 is below half precision's resolution
    bad = mask & ~(torch.isfinite(s) & (s >= 0))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CreditInputError(f"salience: expected finite values >= 0 on valid tokens, got {s[idx].item()} at {idx}")
    a = masked_fill_zero(s + eps, mask)
    # divide by the row's largest score before the power: the ratios (all the normalisation
    # sees) are unchanged, and (tiny)^p can neither underflow to 0/0 nor (large)^p overflow
    top = a.amax(dim=1, keepdim=True)
    live = top > 0  # False only for an all-zero row with eps = 0 (or an empty row)
    a = a / torch.where(live, top, torch.ones_like(top))
    if sharpening != 1.0:
        a = a.pow(sharpening)
    a = masked_fill_zero(a, mask)  # 0 ** 0 = 1 must not count padding
    w = torch.where(live, a / torch.where(live, row_mean(a, mask), torch.ones_like(top)), torch.ones_like(a))
    w = (1.0 - kappa) + kappa * w
    w = w.clamp(min=0.0, max=w_max) if math.isfinite(w_max) else w.clamp(min=0.0)
    return masked_fill_zero(w, mask)


def weighting_metrics(method: str, weights: Tensor, salience: Tensor, mask: Tensor, zero_key: str) -> Dict[str, float]:
    """ARCA's concentration metrics of salience weights, namespaced ``method/...``.

    gini and etr: per-trajectory weight Gini and effective-token ratio, averaged over non-empty
    trajectories; weight_max_mean: mean of each trajectory's largest weight; ``zero_key``: the
    fraction of non-empty trajectories whose salience is all 0 (uniform weights).
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
    eps: float = DEFAULT_EPS  # ref-code: TokenWeightingConfig.eps, added to each residual norm
    sharpening: float = DEFAULT_SHARPENING  # ref-code default 1.0; its MATH configs use 2.0
    kappa: float = DEFAULT_KAPPA  # ref-code: no mix (1.0); < 1 moves toward uniform credit
    w_max: float = DEFAULT_W_MAX  # ref-code: no clip (inf); a finite cap is a tokencredit option

    def __post_init__(self):
        check_weighting("arca", self.eps, self.sharpening, self.kappa, self.w_max)


@register_calibrator(
    "arca",
    config=ARCAConfig,
    requires=("hidden_residual",),
    provenance="ref-code",
    summary="token weights from the LoRA adapter's hidden-state residual, mean 1 per trajectory",
    paired_with="grpo",
    # the paper's A * sum_t w_t grad log pi (sum w = 1) is length-normalised per trajectory:
    # with mean-1 weights that is seq-mean-token-mean; a trainer uses it unless the user sets one
    loss_defaults={"agg_mode": "seq-mean-token-mean"},
    needs_adapter=True,  # the residual is the LoRA adapter's effect: a model without one is an error
)
def arca(batch: CreditBatch, advantages: Tensor, config: ARCAConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "arca")
    w = normalize_salience(
        batch.hidden_residual, batch.mask,
        eps=config.eps, sharpening=config.sharpening, kappa=config.kappa, w_max=config.w_max,
    )
    adv = masked_fill_zero(w.to(advantages.dtype) * advantages.detach(), batch.mask)
    return CreditOutput(
        advantages=adv,
        token_weights=w,
        metrics=weighting_metrics("arca", w, batch.hidden_residual, batch.mask, "zero_residual_frac"),
    )

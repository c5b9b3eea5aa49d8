"""ARCA's intrinsic-signal baselines: the same weighting, a different salience.

    surprisal:   alpha_t = -l_t
    entropy:     alpha_t = max(0, H_t - H_next(t))    entropy reduction; H_next(t) is the entropy
                                                      at the next valid token of the same response,
                                                      alpha = 0 on the last valid token
    divergence:  alpha_t = | l_t - l_ref_t |
    w_t  = clip((1 - kappa) + kappa * n (alpha_t + eps)^p / sum_traj (alpha + eps)^p, 0, w_max)
                                                      (arca.normalize_salience)
    A'_t = w_t * A_t

These are the output-distribution signals the ARCA paper compares its adapter residual with
(and argues degenerate under LoRA). The authors' code (rodlaf/tokenweighting,
``experiment/hf/token_weights.py``) computes all four scores with one normalisation, so the
salience is the only difference and their weight Gini / ETR metrics are directly comparable
with arca's. Surprisal and entropy are non-negative in exact arithmetic; a round-off surprisal
below 0 is read as 0 rather than rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero
from ..registry import CreditOutput, register_calibrator
from .arca import (
    DEFAULT_EPS,
    DEFAULT_KAPPA,
    DEFAULT_SHARPENING,
    DEFAULT_W_MAX,
    check_weighting,
    normalize_salience,
    weighting_metrics,
)

__all__ = [
    "SurprisalConfig", "EntropyConfig", "DivergenceConfig",
    "surprisal", "entropy", "divergence", "entropy_reduction",
]

# the paper's estimator A * sum_t w_t grad log pi (sum w = 1) is length-normalised per
# trajectory; with tokencredit's mean-1 weights that is seq-mean-token-mean (as ARCA)
_LOSS_DEFAULTS = {"agg_mode": "seq-mean-token-mean"}


@dataclass
class SurprisalConfig:
    eps: float = DEFAULT_EPS  # ref-code: one TokenWeightingConfig for every score (eps 1e-8)
    sharpening: float = DEFAULT_SHARPENING  # ref-code default 1.0 (MATH configs: 2.0)
    kappa: float = DEFAULT_KAPPA  # ref-code: no mix
    w_max: float = DEFAULT_W_MAX  # ref-code: no clip

    def __post_init__(self):
        check_weighting("surprisal", self.eps, self.sharpening, self.kappa, self.w_max)


@dataclass
class EntropyConfig:
    eps: float = DEFAULT_EPS  # ref-code: one TokenWeightingConfig for every score (eps 1e-8)
    sharpening: float = DEFAULT_SHARPENING  # ref-code default 1.0 (MATH configs: 2.0)
    kappa: float = DEFAULT_KAPPA  # ref-code: no mix
    w_max: float = DEFAULT_W_MAX  # ref-code: no clip

    def __post_init__(self):
        check_weighting("entropy", self.eps, self.sharpening, self.kappa, self.w_max)


@dataclass
class DivergenceConfig:
    eps: float = DEFAULT_EPS  # ref-code: one TokenWeightingConfig for every score (eps 1e-8)
    sharpening: float = DEFAULT_SHARPENING  # ref-code default 1.0 (MATH configs: 2.0)
    kappa: float = DEFAULT_KAPPA  # ref-code: no mix
    w_max: float = DEFAULT_W_MAX  # ref-code: no clip

    def __post_init__(self):
        check_weighting("divergence", self.eps, self.sharpening, self.kappa, self.w_max)


def entropy_reduction(entropy: Tensor, mask: Tensor) -> Tensor:
    """``max(0, H_t - H_next(t))`` on valid tokens, H_next(t) the entropy at the next valid token
    of the same row; 0 on each row's last valid token and on padding (never read)."""
    mask = mask.bool()
    B, T = mask.shape
    H = masked_fill_zero(entropy.detach(), mask)
    if T == 0:
        return H
    pos = torch.arange(T, device=mask.device).expand(B, T)
    valid_pos = torch.where(mask, pos, torch.full_like(pos, T))
    # first valid position at or after t (T if none), then shifted: first valid position after t
    at_or_after = valid_pos.flip(1).cummin(dim=1).values.flip(1)
    after = torch.cat([at_or_after[:, 1:], torch.full_like(at_or_after[:, :1], T)], dim=1)
    has_next = mask & (after < T)
    H_next = H.gather(1, after.clamp(max=T - 1))
    drop = (H - H_next).clamp(min=0.0)
    return torch.where(has_next, drop, torch.zeros_like(drop))


def _salience_credit(name: str, batch: CreditBatch, advantages: Tensor, salience: Tensor, config) -> CreditOutput:
    w = normalize_salience(
        salience, batch.mask, eps=config.eps, sharpening=config.sharpening, kappa=config.kappa, w_max=config.w_max,
    )
    adv = masked_fill_zero(w.to(advantages.dtype) * advantages.detach(), batch.mask)
    return CreditOutput(
        advantages=adv,
        token_weights=w,
        metrics=weighting_metrics(name, w, salience, batch.mask, "zero_salience_frac"),
    )


@register_calibrator(
    "surprisal",
    config=SurprisalConfig,
    requires=("logprobs",),
    provenance="ref-code",
    summary="ARCA baseline: token weights from surprisal -log p, mean 1 per trajectory",
    paired_with="grpo",
    loss_defaults=_LOSS_DEFAULTS,
)
def surprisal(batch: CreditBatch, advantages: Tensor, config: SurprisalConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "surprisal")
    return _salience_credit("surprisal", batch, advantages, (-batch.logprobs.detach()).clamp(min=0.0), config)


@register_calibrator(
    "entropy",
    config=EntropyConfig,
    requires=("entropy",),
    provenance="ref-code",
    summary="ARCA baseline: token weights from the entropy reduction max(0, H_t - H_t+1), mean 1 per trajectory",
    paired_with="grpo",
    loss_defaults=_LOSS_DEFAULTS,
)
def entropy(batch: CreditBatch, advantages: Tensor, config: EntropyConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "entropy")
    return _salience_credit("entropy", batch, advantages, entropy_reduction(batch.entropy, batch.mask), config)


@register_calibrator(
    "divergence",
    config=DivergenceConfig,
    requires=("logprobs", "ref_logprobs"),
    provenance="ref-code",
    summary="ARCA baseline: token weights from |log p - log p_ref|, mean 1 per trajectory",
    paired_with="grpo",
    loss_defaults=_LOSS_DEFAULTS,
)
def divergence(batch: CreditBatch, advantages: Tensor, config: DivergenceConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "divergence")
    return _salience_credit("divergence", batch, advantages, (batch.logprobs - batch.ref_logprobs).detach().abs(), config)

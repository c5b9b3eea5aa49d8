"""ARCA's intrinsic-signal baselines: the same weighting, a different salience.

    surprisal:   s_t = -l_t
    entropy:     s_t = H_t
    divergence:  s_t = | l_t - l_ref_t |
    w_t  = clip((1 - kappa) + kappa * s_t / mean_traj(s), 0, w_max)   (arca.normalize_salience)
    A'_t = w_t * A_t

These are the output-distribution signals the ARCA paper compares its adapter residual with
(and argues degenerate under LoRA); normalising them exactly as ARCA does makes the salience
the only difference, so their weight Gini / ETR metrics are directly comparable with arca's.
Surprisal and entropy are non-negative in exact arithmetic; a round-off value below 0 is read
as 0 rather than rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero
from ..registry import CreditOutput, register_calibrator
from .arca import DEFAULT_KAPPA, DEFAULT_W_MAX, check_weighting, normalize_salience, weighting_metrics

__all__ = ["SurprisalConfig", "EntropyConfig", "DivergenceConfig", "surprisal", "entropy", "divergence"]


@dataclass
class SurprisalConfig:
    kappa: float = DEFAULT_KAPPA  # as ARCA (paper: baselines normalised the same way)
    w_max: float = DEFAULT_W_MAX  # as ARCA (paper: baselines normalised the same way)

    def __post_init__(self):
        check_weighting("surprisal", self.kappa, self.w_max)


@dataclass
class EntropyConfig:
    kappa: float = DEFAULT_KAPPA  # as ARCA (paper: baselines normalised the same way)
    w_max: float = DEFAULT_W_MAX  # as ARCA (paper: baselines normalised the same way)

    def __post_init__(self):
        check_weighting("entropy", self.kappa, self.w_max)


@dataclass
class DivergenceConfig:
    kappa: float = DEFAULT_KAPPA  # as ARCA (paper: baselines normalised the same way)
    w_max: float = DEFAULT_W_MAX  # as ARCA (paper: baselines normalised the same way)

    def __post_init__(self):
        check_weighting("divergence", self.kappa, self.w_max)


def _salience_credit(name: str, batch: CreditBatch, advantages: Tensor, salience: Tensor, config) -> CreditOutput:
    w = normalize_salience(salience, batch.mask, config.kappa, config.w_max)
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
    provenance="paper",
    summary="ARCA baseline: token weights from surprisal -log p, mean 1 per trajectory",
    paired_with="grpo",
)
def surprisal(batch: CreditBatch, advantages: Tensor, config: SurprisalConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "surprisal")
    batch.require("surprisal", ["logprobs"])
    return _salience_credit("surprisal", batch, advantages, (-batch.logprobs.detach()).clamp(min=0.0), config)


@register_calibrator(
    "entropy",
    config=EntropyConfig,
    requires=("entropy",),
    provenance="paper",
    summary="ARCA baseline: token weights from the next-token entropy, mean 1 per trajectory",
    paired_with="grpo",
)
def entropy(batch: CreditBatch, advantages: Tensor, config: EntropyConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "entropy")
    batch.require("entropy", ["entropy"])
    return _salience_credit("entropy", batch, advantages, batch.entropy.detach().clamp(min=0.0), config)


@register_calibrator(
    "divergence",
    config=DivergenceConfig,
    requires=("logprobs", "ref_logprobs"),
    provenance="paper",
    summary="ARCA baseline: token weights from |log p - log p_ref|, mean 1 per trajectory",
    paired_with="grpo",
)
def divergence(batch: CreditBatch, advantages: Tensor, config: DivergenceConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "divergence")
    batch.require("divergence", ["logprobs", "ref_logprobs"])
    return _salience_credit("divergence", batch, advantages, (batch.logprobs - batch.ref_logprobs).detach().abs(), config)

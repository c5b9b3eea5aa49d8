"""GRPO (Shao et al. 2024, DeepSeekMath): group-normalised outcome advantage, uniform credit.

    A_b = (R_b - mean_g R) / (std_g R + eps)        (std_normalize=True)
    A_b =  R_b - mean_g R                           (std_normalize=False)
    A_{b,t} = A_b on every valid token
"""

from __future__ import annotations

from dataclasses import dataclass

from ..batch import CreditBatch
from ..ops import broadcast_to_tokens, group_mean, group_std, groups_of
from ..registry import CreditOutput, register_estimator


@dataclass
class GRPOConfig:
    std_normalize: bool = True  # DeepSeekMath eq. for outcome supervision; verl norm_adv_by_std_in_grpo=True
    eps: float = 1e-6  # verl core_algos.compute_grpo_outcome_advantage epsilon
    std_unbiased: bool = True  # torch.std default, as in verl and TRL

    def __post_init__(self):
        if not self.eps > 0:
            raise ValueError(f"grpo eps: expected > 0, got {self.eps}")


@register_estimator(
    "grpo",
    config=GRPOConfig,
    provenance="paper",
    summary="group-normalised outcome advantage broadcast to every token",
    needs_groups=True,
)
def grpo(batch: CreditBatch, config: GRPOConfig) -> CreditOutput:
    g = groups_of(batch, "grpo")
    r = batch.rewards
    adv = r - group_mean(r, g)
    if config.std_normalize:
        adv = adv / (group_std(r, g, unbiased=config.std_unbiased) + config.eps)
    return CreditOutput(
        advantages=broadcast_to_tokens(adv, batch.mask),
        metrics={"grpo/seq_adv_abs_mean": adv.abs().mean().item()},
    )

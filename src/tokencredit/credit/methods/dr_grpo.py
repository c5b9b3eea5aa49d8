"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO without the std.

    A_b     = R_b - mean_g R                 (no division by the group's std)
    A_{b,t} = A_b on every valid token

Dividing by the group std up-weights prompts that are nearly always solved or nearly always
failed (a question-difficulty bias); Dr. GRPO drops it. Its second fix, removing the per-
response length normalisation, lives in the loss, not in the credit: pair this estimator with
the ``seq-mean-token-sum-norm`` loss aggregation (sum over a response's tokens divided by a
constant, then mean over responses), which the estimator declares (``loss_defaults``): a trainer
uses it, with the generation budget ``max_new_tokens`` as the constant (the paper's choice:
"the maximum completion length"), unless the user sets ``loss.agg_mode`` / ``loss.norm_constant``.
The advantage alone equals ``grpo`` with ``std_normalize=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..batch import CreditBatch
from ..ops import broadcast_to_tokens, group_mean, groups_of
from ..registry import CreditOutput, register_estimator

__all__ = ["DrGRPOConfig", "dr_grpo"]


@dataclass
class DrGRPOConfig:
    """No constants: the advantage is the mean-centred outcome (Liu et al. 2025, eq. for Dr. GRPO;
    verl ``compute_grpo_outcome_advantage`` with ``norm_adv_by_std_in_grpo=False``)."""


@register_estimator(
    "dr_grpo",
    config=DrGRPOConfig,
    provenance="paper",
    summary="group-mean-centred outcome advantage (no std division) broadcast to every token; "
    "pair with seq-mean-token-sum-norm loss aggregation",
    needs_groups=True,
    loss_defaults={"agg_mode": "seq-mean-token-sum-norm", "norm_constant": "max_new_tokens"},
)
def dr_grpo(batch: CreditBatch, config: DrGRPOConfig) -> CreditOutput:
    g = groups_of(batch, "dr_grpo")
    r = batch.rewards.detach()
    adv = r - group_mean(r, g)
    return CreditOutput(
        advantages=broadcast_to_tokens(adv, batch.mask),
        metrics={"dr_grpo/seq_adv_abs_mean": adv.abs().mean().item()},
    )

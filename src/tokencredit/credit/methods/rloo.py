"""RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): leave-one-out baseline.

    A_b     = R_b - mean_{j in g, j != b} R_j  =  K / (K - 1) * (R_b - mean_g R)
    A_{b,t} = A_b on every valid token

K is the size of b's group. The baseline excludes the response itself, so it is independent
of that response and the policy-gradient estimate stays unbiased; this needs K >= 2 (a
singleton group is rejected).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..batch import CreditBatch
from ..ops import broadcast_to_tokens, groups_of
from ..registry import CreditOutput, register_estimator

__all__ = ["RLOOConfig", "rloo"]


@dataclass
class RLOOConfig:
    """No constants: the leave-one-out mean is the whole method (Ahmadian et al. 2024, eq. for
    RLOO; verl ``compute_rloo_outcome_advantage``)."""


@register_estimator(
    "rloo",
    config=RLOOConfig,
    provenance="paper",
    summary="outcome minus the leave-one-out mean of the other responses in the group, broadcast",
    needs_groups=True,
)
def rloo(batch: CreditBatch, config: RLOOConfig) -> CreditOutput:
    g = groups_of(batch, "rloo", min_size=2)
    r = batch.rewards.detach()
    total = r.new_zeros(g.n).index_add_(0, g.index, r)[g.index]
    k = g.counts.to(r.dtype)[g.index]
    # subtracting the response from its group's sum, rather than rescaling R - mean, keeps the
    # baseline literally the mean of the others
    adv = r - (total - r) / (k - 1)
    return CreditOutput(
        advantages=broadcast_to_tokens(adv, batch.mask),
        metrics={"rloo/seq_adv_abs_mean": adv.abs().mean().item()},
    )

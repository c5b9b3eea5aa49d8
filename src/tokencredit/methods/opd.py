"""OPD / SDPO (on-policy distillation; self-distillation with privileged context).

    e_t     = log pi_O(y_t | ...) - log pi_theta(y_t | h_t)     oracle_logprobs - logprobs, detached
    e_t     = clip(e_t, -clip, clip)                             only if ``clip`` is set
    A_{b,t} = coefficient * e_t                                  on every valid token

The oracle O is a stronger frozen teacher (on-policy distillation) or the policy itself given
privileged context such as the reference answer (self-distillation, SDPO). Summed over the
response, ``sum_t -e_t`` is the single-sample estimate of the reverse KL
KL(pi_theta || pi_O) on the sampled tokens, so maximising ``sum_t A_t log pi_theta(y_t)``
with A_t = e_t is the per-token negative reverse-KL reward of on-policy distillation. No
outcome reward and no groups are used. OPPO's advantage reduces to this one when its
accumulation and state weight are switched off (``oppo.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..batch import CreditBatch
from ..ops import masked_fill_zero, masked_mean
from ..registry import CreditOutput, register_estimator

__all__ = ["OPDConfig", "opd", "distillation_evidence"]


@dataclass
class OPDConfig:
    # the OPD reward is the raw log-ratio (on-policy distillation; docs/methods.md "OPD / SDPO");
    # a clip bounds the reward where teacher and student disagree wildly (None = no clip)
    clip: Optional[float] = None
    # the reward enters the policy gradient with weight 1 in on-policy distillation
    coefficient: float = 1.0

    def __post_init__(self):
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise ValueError(f"opd clip: expected None or a number > 0 (math.inf allowed), got {self.clip!r}")
        if not (isinstance(self.coefficient, (int, float)) and math.isfinite(self.coefficient) and self.coefficient > 0):
            raise ValueError(f"opd coefficient: expected a finite number > 0, got {self.coefficient!r}")


def distillation_evidence(batch: CreditBatch, clip: Optional[float] = None):
    """The detached log-ratio e_t = oracle_logprobs - logprobs on valid tokens, 0 on padding.

    Returns ``(e, raw)``: ``e`` clipped to [-clip, clip] when ``clip`` is a finite number,
    ``raw`` the unclipped log-ratio (for clip statistics). Shared with OPPO so both methods
    read the same evidence.
    """
    raw = masked_fill_zero(batch.oracle_logprobs.detach() - batch.logprobs.detach(), batch.mask)
    e = raw.clamp(-clip, clip) if clip is not None and math.isfinite(clip) else raw
    return e, raw


@register_estimator(
    "opd",
    config=OPDConfig,
    requires=("oracle_logprobs", "logprobs"),
    provenance="paper",
    summary="per-token log-ratio of oracle (teacher or privileged self) to policy: negative reverse-KL reward",
)
def opd(batch: CreditBatch, config: OPDConfig) -> CreditOutput:
    batch.require("opd", ("oracle_logprobs", "logprobs"))
    e, raw = distillation_evidence(batch, config.clip)
    adv = masked_fill_zero(config.coefficient * e, batch.mask)
    m = batch.mask
    clipped = m & (raw.abs() > config.clip) if config.clip is not None else torch.zeros_like(m)
    return CreditOutput(
        advantages=adv,
        metrics={
            "opd/reward_mean": masked_mean(e, m).item(),
            # -mean(raw log-ratio): per-token reverse-KL estimate on the sampled tokens
            "opd/reverse_kl_est": -masked_mean(raw, m).item(),
            "opd/clip_frac": masked_mean(clipped.to(e.dtype), m).item(),
        },
    )

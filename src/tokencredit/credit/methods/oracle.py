"""Oracle credit: the true credit of the current policy, the ceiling of token-level credit.

    V_t     = V(h_t)                                 true_values: the policy's exact value of the
                                                     state before token t (enumerated, exactvalue)
    V_{L}   := R                                     after the last token, the outcome itself
    c_t     = V_{t+1} - V_t                          sum_t c_t = R - V(h_0)  (telescopes)
    A_{b,t} = c_t / s_g                              normalize="group": s_g = std_g R + eps as GRPO,
                                                     the batch's std where a group's rewards are all
                                                     equal (1 if the batch's are too)
                                                     "batch": s = std_B R + eps (1 if 0); "none": s = 1

c_t is PACT's true credit (the advantage of token t under the policy that sampled it, with the
exact value as baseline); the fidelity package scores every method against the same quantity.
Declares ``true_values``: the trainer enumerates every continuation of the batch's prompts, which
needs a task with a response space (``tokencredit bench``'s tasks); the plan refuses it elsewhere.
The normalisation keeps GRPO's scale, so that a comparison with GRPO measures where the credit
goes, not how large it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import CreditBatch
from ..ops import group_std, groups_of, masked_fill_zero, masked_mean
from ..registry import CreditOutput, register_estimator


@dataclass
class OracleConfig:
    normalize: str = "group"  # group | batch | none (see the module docstring)
    eps: float = 1e-6  # as GRPO's

    def __post_init__(self):
        if self.normalize not in ("group", "batch", "none"):
            raise ValueError(f"oracle normalize: expected 'group', 'batch' or 'none', got {self.normalize!r}")
        if not self.eps > 0:
            raise ValueError(f"oracle eps: expected > 0, got {self.eps}")


def true_credit(batch: CreditBatch) -> torch.Tensor:
    """``[B, T]`` c_t = V(h_{t+1}) - V(h_t), with V after each row's last valid token := its reward."""
    m = batch.mask
    v = masked_fill_zero(batch.true_values.to(batch.rewards.dtype), m)
    nxt = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    last = m & ~torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], dim=1)  # each row's last valid token
    nxt = torch.where(last, batch.rewards.unsqueeze(1).expand_as(v), nxt)
    return masked_fill_zero(nxt - v, m)


@register_estimator(
    "oracle",
    config=OracleConfig,
    requires=("true_values",),
    provenance="reconstructed",
    summary="true credit c_t = V(h_{t+1}) - V(h_t) of the current policy, V exact by enumeration (the ceiling)",
    needs_groups=True,
)
def oracle(batch: CreditBatch, config: OracleConfig) -> CreditOutput:
    c = true_credit(batch)
    r = batch.rewards
    s_batch = r.std() if r.numel() > 1 else r.new_zeros(())
    s_batch = s_batch + config.eps if s_batch > 0 else r.new_ones(())
    if config.normalize == "group":
        s = group_std(r, groups_of(batch, "oracle"))
        s = torch.where(s > 0, s + config.eps, s_batch)
    elif config.normalize == "batch":
        s = s_batch.expand_as(r)
    else:
        s = r.new_ones(r.shape)
    adv = masked_fill_zero(c / s.unsqueeze(1), batch.mask)
    v0 = batch.true_values[:, 0]
    return CreditOutput(
        advantages=adv,
        metrics={
            "oracle/v0_mean": float(v0.mean()),
            "oracle/credit_abs_mean": masked_mean(c.abs(), batch.mask).item(),
        },
    )

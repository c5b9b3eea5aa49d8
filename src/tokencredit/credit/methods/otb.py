"""OTB, the optimal token baseline (Li et al. 2026, arXiv 2602.07078; verl's
``optimal_token_baseline``): a per-token baseline weighted by the policy's realized energy.

With ``pi_t = exp(logprobs_t)`` the probability of the sampled token and
``S_t = sum_v pi_v^2`` the next-token distribution's collision probability (``sum_pi_squared``,
both from the policy pass before the update, as verl's actor gives ``old_log_probs`` and
``sum_pi_squared`` from one forward)::

    w_t  = 1 - 2 pi_t + S_t  (= ||onehot(y_t) - pi||^2, the logit-gradient proxy of step t)
    W_t  = sum_{j <= t, valid} w_j                       (realized energy up to t)
    G_t  = R on every valid token                        (reward-to-go of an outcome reward)
    B_t  = sum_{i in group} G_t^i W_t^i m_t^i / (sum_{i in group} W_t^i m_t^i + eps)
    A_t  = (G_t - B_t) m_t

A group of one response is refused, as by every group-relative method here (verl gives it no
baseline, ``A = G``; the house contract, tests/test_properties.py). ``handle_zero_tail``: in a group whose
longest response is unique, its baseline is 0 from the second-longest response's length on
(where it alone is alive, ``B_t`` would be its own return).

Provenance: **ref-code**: ``volcengine/verl`` ``verl/trainer/ppo/core_algos.py``
``compute_optimal_token_baseline_advantage`` (``epsilon`` 1e-8, ``handle_zero_tail`` False),
``verl/utils/torch_functional.py`` ``calculate_sum_pi_squared_from_logits`` and
``docs/algo/otb.md``. Not here: verl's ``rollout_is_weights`` (``w_t`` times the rollout IS
weight squared when rollout correction is on; verl's default is off), and verl multiplies by
the mask where tokencredit selects with it (padding may hold anything; equal on finite values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import Groups, groups_of, masked_fill_zero, masked_mean
from ..registry import CreditOutput, register_estimator

__all__ = ["OTBConfig", "otb"]


@dataclass
class OTBConfig:
    # verl compute_optimal_token_baseline_advantage: epsilon added to the group's sum of W_t
    eps: float = 1e-8
    # verl: False for optimal_token_baseline (True in its multi-turn variant): a unique longest
    # response's baseline is 0 beyond the second-longest response's length
    handle_zero_tail: bool = False

    def __post_init__(self):
        e = self.eps
        if not (isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) and e > 0):
            raise ValueError(f"otb eps: expected a finite number > 0, got {e!r}")
        if not isinstance(self.handle_zero_tail, bool):
            raise ValueError(f"otb handle_zero_tail: expected a bool, got {self.handle_zero_tail!r}")


def _group_sum(x: Tensor, g: Groups) -> Tensor:
    """[B, ...] -> [n, ...]: the sum of each group's rows."""
    return torch.zeros((g.n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, g.index, x)


def _group_max(x: Tensor, g: Groups) -> Tensor:
    """[B] -> [n]: each group's largest value."""
    return torch.full((g.n,), -1, dtype=x.dtype, device=x.device).scatter_reduce(0, g.index, x, "amax")


def _zero_tail(m: Tensor, g: Groups) -> Tensor:
    """Bool [B, T]: the positions of a group's unique longest response from the second-longest
    response's length on (verl's ``handle_zero_tail``; lengths are token counts)."""
    L = m.sum(1)
    top = _group_max(L, g)[g.index]
    at_top = L == top
    unique = _group_sum(at_top.long(), g)[g.index] == 1
    second = _group_max(torch.where(at_top, torch.full_like(L, -1), L), g)[g.index]
    row = at_top & unique
    cols = torch.arange(m.shape[1], device=m.device).unsqueeze(0) >= second.unsqueeze(1)
    return row.unsqueeze(1) & cols


@register_estimator(
    "otb",
    config=OTBConfig,
    requires=("logprobs", "sum_pi_squared"),
    provenance="ref-code",
    summary="per-token baseline: the group's returns weighted by the realized energy sum_j (1 - 2 pi_j + sum pi^2)",
    needs_groups=True,
)
def otb(batch: CreditBatch, config: OTBConfig) -> CreditOutput:
    g = groups_of(batch, "otb")  # a group of one is refused (verl: A = G)
    m = batch.mask
    dt = torch.promote_types(batch.rewards.dtype, torch.promote_types(batch.logprobs.dtype, batch.sum_pi_squared.dtype))
    pi = masked_fill_zero(batch.logprobs.detach().to(dt), m).exp()
    w = 1 - 2 * pi + masked_fill_zero(batch.sum_pi_squared.detach().to(dt), m)
    W = masked_fill_zero(w, m).cumsum(dim=1)
    G = masked_fill_zero(batch.rewards.detach().to(dt).unsqueeze(1).expand_as(W), m)

    num = _group_sum(masked_fill_zero(G * W, m), g)
    den = _group_sum(masked_fill_zero(W, m), g) + config.eps
    base = (num / den)[g.index]
    if config.handle_zero_tail:
        base = base.masked_fill(_zero_tail(m, g), 0.0)
    adv = masked_fill_zero(G - base, m)
    return CreditOutput(
        advantages=adv,
        metrics={
            "otb/w_mean": masked_mean(w, m).item(),
            "otb/baseline_mean": masked_mean(base, m).item(),
            "otb/adv_abs_mean": masked_mean(adv.abs(), m).item(),
        },
    )

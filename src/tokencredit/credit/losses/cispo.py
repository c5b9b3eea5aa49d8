"""CISPO (MiniMax-M1, Chen et al. 2025): clip the importance-sampling weight, not the update.

With ``r_t`` the importance ratio (token, or GSPO's sequence ratio: ``importance_sampling_level``)
and ``sg`` the stop-gradient::

    w_t = sg[ clip(r_t, 1 - epsilon_low, epsilon_high) ]     (no lower bound when epsilon_low is None)
    l_t = -w_t A_t log pi(y_t)

so every token keeps a gradient ``w_t A_t grad log pi`` (a clipped PPO token outside the range
has none): the weight is truncated, the update never switched off.

Names as TRL's ``loss_type="cispo"``: ``epsilon_high`` is the cap on the weight itself (TRL's
epsilon_high for CISPO, ScaleRL's epsilon_max; TRL recommends 5.0), with no lower bound, as the
MiniMax-M1 paper runs it ("we do not impose a lower bound"). verl's ``compute_policy_loss_cispo``
clips both sides at ``1 - clip_ratio_low`` and ``1 + clip_ratio_high``: ``epsilon_low=clip_ratio_low,
epsilon_high=1 + clip_ratio_high`` here. Aggregation ``token-mean`` (TRL's and verl's for CISPO).
Provenance: **ref-code** (TRL ``GRPOTrainer._compute_loss``, verl ``core_algos.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .aggregation import aggregate, check_agg_mode
from .policy import (
    check_is_level,
    check_number,
    importance_log_ratio,
    loss_config,
    prepare_inputs,
    ratio_metrics,
    register_policy_loss,
    valid_mean,
)

__all__ = ["CISPOLossConfig", "cispo_loss"]


@dataclass
class CISPOLossConfig:
    epsilon_high: float = 5.0  # TRL's epsilon_high for loss_type="cispo" (ScaleRL's epsilon_max, TRL's recommendation)
    epsilon_low: Optional[float] = None  # None: no lower bound (MiniMax-M1, TRL); verl: its clip_ratio_low
    agg_mode: str = "token-mean"  # TRL and verl for CISPO
    norm_constant: Optional[float] = None  # only for seq-mean-token-sum-norm
    log_ratio_clamp: float = 20.0  # verl clamps l - l_old to [-20, 20] before exp
    importance_sampling_level: str = "token"  # TRL's option: "sequence" weights by GSPO's sequence ratio

    def __post_init__(self):
        check_number("cispo", "epsilon_high", self.epsilon_high, low=1, expected="a number >= 1 (a cap on the ratio)")
        if self.epsilon_low is not None:
            check_number("cispo", "epsilon_low", self.epsilon_low, low=0, high=1, high_open=True,
                          expected="None or a number in [0, 1)")
        check_number("cispo", "log_ratio_clamp", self.log_ratio_clamp, low=0, low_open=True, expected="a number > 0")
        check_is_level("cispo", self.importance_sampling_level)
        check_agg_mode(self.agg_mode, self.norm_constant)


@register_policy_loss(
    "cispo",
    config=CISPOLossConfig,
    provenance="ref-code",
    summary="REINFORCE on log pi weighted by the stop-gradient ratio truncated at epsilon_high (CISPO)",
)
def cispo_loss(logprobs, old_logprobs, advantages, response_mask, config: Optional[CISPOLossConfig] = None,
               loss_weights=None) -> Tuple[Tensor, Dict[str, float]]:
    cfg = loss_config("cispo", CISPOLossConfig, config)
    mask, lp, old, adv, w = prepare_inputs(logprobs, old_logprobs, advantages, response_mask, loss_weights)
    log_ratio = importance_log_ratio(lp, old, mask, cfg.importance_sampling_level, cfg.log_ratio_clamp)
    ratio = log_ratio.exp()
    low = 1.0 - cfg.epsilon_low if cfg.epsilon_low is not None else None
    weight = ratio.detach().clamp(min=low, max=cfg.epsilon_high)
    per_tok = -weight * adv * lp
    if w is not None:
        per_tok = per_tok * w
    loss = aggregate(per_tok, mask, cfg.agg_mode, norm_constant=cfg.norm_constant)

    with torch.no_grad():
        r = ratio.detach()
        high = mask & (r > cfg.epsilon_high)
        below = mask & (r < low) if low is not None else torch.zeros_like(mask)
        n = max(int(mask.sum()), 1)
        metrics = {
            "cispo/clip_frac_high": int(high.sum()) / n,
            "cispo/clip_frac": int((high | below).sum()) / n,
            "cispo/weight_mean": valid_mean(weight, mask),
            **ratio_metrics("cispo", log_ratio, ratio, mask),
        }
    return loss, metrics

"""TACO (Tail-Aware Credit calibratiOn): damp positive credit on tokens in the unreliable tail.

    r_t  = -l_t - H_t + log(alpha)          tail risk: surprisal exceeds the entropy by > log(1/alpha)
    w_t  = (1 - lam) + lam * exp(-r_t)      if r_t > 0     (= 1 - lam (1 - exp(-r_t)), in [1 - lam, 1])
    w_t  = 1                                otherwise
    A'_t = w_t * A_t   if A_t > 0  else  A_t                only positive credit is calibrated

``l_t`` is the current policy's log-prob of the sampled token and ``H_t`` the full-vocabulary
entropy, both from the actor forward that produces the loss (detached). Subtracting the entropy
separates "unexpected rarity" (a rare token where the model was confident) from exploration (a
rare token where the model was uncertain): only the former is in the tail. The weight is written
as ``(1 - lam) + lam exp(-r)`` so that, in floating point too, ``w >= 1 - lam > 0`` whenever
``lam < 1``: TACO never removes a positive gradient, it only shrinks it.

Two of the paper's baselines are offered through ``mode`` (same positive-only rule):

* ``"prob_reweight"``: ``w_t = (1 - a) + a * p_t`` with ``p_t = exp(l_t)``. The paper uses the
  behaviour policy's ``p_old``; a method's ``requires`` is static, so this variant reads the
  current-policy ``logprobs`` that TACO already declares (on-policy the two coincide at the
  first PPO epoch).
* ``"mask_low_prob"``: ``w_t = 0`` where ``p_t < mask_prob`` and ``H_t < mask_entropy``, else 1.

Provenance: reference code (xiuyilou/TACO, a verl 0.8 fork), summarised in docs/methods.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero, masked_mean
from ..registry import CreditOutput, register_calibrator

__all__ = ["TACOConfig", "taco", "tail_risk", "MODES"]

MODES = ("taco", "prob_reweight", "mask_low_prob")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class TACOConfig:
    alpha: float = 0.01  # reference code default: tail when p_t < alpha * exp(-H_t)
    lam: float = 0.9  # reference code default: a tail token keeps at least 1 - lam = 10% of its credit
    mode: str = "taco"  # "taco" | paper baselines "prob_reweight" | "mask_low_prob"
    reweight_a: float = 0.1  # paper baseline A * ((1 - a) + a p): a = 0.1 (docs/methods.md)
    mask_prob: float = 0.002  # paper baseline: mask positive tokens with p < 0.002 (docs/methods.md)
    # reconstructed: docs/methods.md says only "low entropy"; 1 nat separates near-deterministic
    # positions (a clear favourite) from genuinely open ones, so masked tokens are rare
    # tokens sampled where the model was confident, the same rarity TACO's tail targets
    mask_entropy: float = 1.0

    def __post_init__(self):
        if not (_is_number(self.alpha) and self.alpha > 0):
            raise ValueError(f"taco alpha: expected a finite number > 0, got {self.alpha!r}")
        if not (_is_number(self.lam) and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"taco lam: expected a number in [0, 1], got {self.lam!r}")
        if self.mode not in MODES:
            raise ValueError(f"taco mode: expected one of {MODES}, got {self.mode!r}")
        if not (_is_number(self.reweight_a) and 0.0 <= self.reweight_a <= 1.0):
            raise ValueError(f"taco reweight_a: expected a number in [0, 1], got {self.reweight_a!r}")
        if not (_is_number(self.mask_prob) and 0.0 <= self.mask_prob <= 1.0):
            raise ValueError(f"taco mask_prob: expected a probability in [0, 1], got {self.mask_prob!r}")
        if not (_is_number(self.mask_entropy) and self.mask_entropy >= 0.0):
            raise ValueError(f"taco mask_entropy: expected a finite number >= 0, got {self.mask_entropy!r}")


def tail_risk(logprobs: Tensor, entropy: Tensor, alpha: float) -> Tensor:
    """``r_t = -l_t - H_t + log(alpha)``: > 0 means the token is in the tail."""
    return -logprobs - entropy + math.log(alpha)


def _weights(config: TACOConfig, logp: Tensor, ent: Tensor, r: Tensor) -> Tensor:
    one = logp.new_ones(())
    if config.mode == "taco":
        # exp(-r) only matters where r > 0; clamping keeps exp finite on the other tokens
        w = (1.0 - config.lam) + config.lam * torch.exp(-r.clamp_min(0.0))
        return torch.where(r > 0, w.clamp_max(1.0), one)
    p = torch.exp(logp)
    if config.mode == "prob_reweight":
        return ((1.0 - config.reweight_a) + config.reweight_a * p).clamp_max(1.0)
    low = (p < config.mask_prob) & (ent < config.mask_entropy)
    return torch.where(low, logp.new_zeros(()), one)


@register_calibrator(
    "taco",
    config=TACOConfig,
    requires=("logprobs", "entropy"),
    provenance="ref-code",
    summary="shrinks positive credit on tail tokens (surprisal beyond entropy), never to zero",
    paired_with="grpo",
)
def taco(batch: CreditBatch, advantages: Tensor, config: TACOConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "taco")
    batch.require("taco", ["logprobs", "entropy"])
    mask = batch.mask
    adv = advantages.detach()
    dt = torch.promote_types(batch.logprobs.dtype, adv.dtype)
    # padding may hold NaN: zero it before any arithmetic so no NaN is ever formed
    logp = masked_fill_zero(batch.logprobs.detach().to(dt), mask)
    ent = masked_fill_zero(batch.entropy.detach().to(dt), mask)
    r = tail_risk(logp, ent, config.alpha)
    pos = mask & (adv > 0)
    w = torch.where(pos, _weights(config, logp, ent, r), logp.new_ones(()))
    # A <= 0 is returned bitwise as given: TACO only touches positive credit
    out = masked_fill_zero(torch.where(pos, w.to(adv.dtype) * adv, adv), mask)
    n_pos = int(pos.sum())
    metrics = {
        "taco/weight_mean": float(masked_mean(w, pos)) if n_pos else 1.0,
        "taco/tail_risk_mean": float(masked_mean(r, mask)),
        "taco/tail_token_frac": float(masked_mean((r > 0).to(dt), mask)),
        "taco/positive_adv_token_frac": float(masked_mean(pos.to(dt), mask)),
    }
    return CreditOutput(advantages=out, token_weights=masked_fill_zero(w, mask), metrics=metrics)

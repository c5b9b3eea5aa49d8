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

The paper's three baselines, as the reference repository implements them (``mode``):

* ``"ar_lopti"`` (advantage reweighting), every valid token whatever the sign of its credit,
  with the rollout (old) policy's probability ``p_old = exp(old_logprobs)``::

      A'_t = ((1 - a) + a * p_old_t) * A_t

* ``"stapo"`` (spurious-token silencing), current policy ``p_t = exp(l_t)``, strict thresholds::

      C     = valid tokens with A_t > 0          (all valid tokens when only_positive is off)
      tau_H = quantile_q({H_t : t in C})         torch.quantile, linear interpolation; over the
                                                 valid tokens if C is empty; per chunk of
                                                 micro_batch_size rows if set
      A'_t  = 0   if t in C and p_t < p_min and H_t < tau_H      else A_t

* ``"tampo"`` (hard truncation), current policy, non-strict thresholds::

      A'_t  = 0   if A_t > 0 and p_t <= p_max and H_t <= H_max    else A_t

The reference removes STAPO's and TAMPO's tokens from the loss mask, so a token-mean loss also
loses them from its denominator; a calibrator can only change advantages, so here they keep a
zero advantage and stay in the denominator. ``taco/silenced_token_frac`` = f is that difference:
the reference's token-mean loss is this one times 1 / (1 - f) (docs/methods.md).

Provenance: reference code (xiuyilou/TACO, a verl 0.8 fork), summarised in docs/methods.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero, masked_mean
from ..registry import CreditOutput, register_calibrator

__all__ = ["TACOConfig", "taco", "tail_risk", "tail_weight", "ar_lopti_weight", "stapo_silence",
           "tampo_truncate", "linear_quantile", "MODES"]

MODES = ("taco", "ar_lopti", "stapo", "tampo")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class TACOConfig:
    alpha: float = 0.01  # reference actor.yaml taco_alpha: tail when p_t < alpha * exp(-H_t)
    lam: float = 0.9  # reference taco_lambda: a tail token keeps at least 1 - lam = 10% of its credit
    mode: str = "taco"  # "taco" | the paper's baselines "ar_lopti" | "stapo" | "tampo"
    # reference adv_reweight_alpha: A ((1 - a) + a p_old), p_old the rollout policy's probability
    ar_lopti_alpha: float = 0.1
    stapo_prob_threshold: float = 0.002  # reference stapo_prob_threshold: silence where p < 0.002
    stapo_entropy_quantile: float = 0.1  # reference stapo_entropy_quantile: ... and H < the 10% quantile
    stapo_only_positive: bool = True  # reference stapo_only_positive_advantage: candidates have A > 0
    # rows per quantile chunk; None = the whole batch passed in. The reference takes the quantile
    # per PPO micro-batch (its ppo_micro_batch_size_per_gpu); the verl plugin calls the method per
    # micro-batch already, tokencredit's trainer once per step on the whole batch
    stapo_micro_batch_size: Optional[int] = None
    tampo_prob_threshold: float = 0.002  # reference tampo_prob_threshold: truncate where p <= 0.002
    tampo_entropy_threshold: float = 0.5  # reference tampo_entropy_threshold: ... and H <= 0.5

    def __post_init__(self):
        if not (_is_number(self.alpha) and self.alpha > 0):
            raise ValueError(f"taco alpha: expected a finite number > 0, got {self.alpha!r}")
        if not (_is_number(self.lam) and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"taco lam: expected a number in [0, 1], got {self.lam!r}")
        if self.mode not in MODES:
            raise ValueError(f"taco mode: expected one of {MODES}, got {self.mode!r}")
        if not (_is_number(self.ar_lopti_alpha) and 0.0 <= self.ar_lopti_alpha <= 1.0):
            raise ValueError(f"taco ar_lopti_alpha: expected a number in [0, 1], got {self.ar_lopti_alpha!r}")
        # the reference's own checks: both open intervals
        if not (_is_number(self.stapo_prob_threshold) and 0.0 < self.stapo_prob_threshold < 1.0):
            raise ValueError(
                f"taco stapo_prob_threshold: expected a probability in (0, 1), got {self.stapo_prob_threshold!r}"
            )
        if not (_is_number(self.stapo_entropy_quantile) and 0.0 < self.stapo_entropy_quantile < 1.0):
            raise ValueError(
                f"taco stapo_entropy_quantile: expected a number in (0, 1), got {self.stapo_entropy_quantile!r}"
            )
        if not isinstance(self.stapo_only_positive, bool):
            raise ValueError(f"taco stapo_only_positive: expected a bool, got {self.stapo_only_positive!r}")
        mbs = self.stapo_micro_batch_size
        if mbs is not None and not (isinstance(mbs, int) and not isinstance(mbs, bool) and mbs >= 1):
            raise ValueError(f"taco stapo_micro_batch_size: expected None or an int >= 1, got {mbs!r}")
        if not (_is_number(self.tampo_prob_threshold) and 0.0 <= self.tampo_prob_threshold <= 1.0):
            raise ValueError(
                f"taco tampo_prob_threshold: expected a probability in [0, 1], got {self.tampo_prob_threshold!r}"
            )
        if not (_is_number(self.tampo_entropy_threshold) and self.tampo_entropy_threshold >= 0.0):
            raise ValueError(
                f"taco tampo_entropy_threshold: expected a finite number >= 0, got {self.tampo_entropy_threshold!r}"
            )


def tail_risk(logprobs: Tensor, entropy: Tensor, alpha: float) -> Tensor:
    """``r_t = -l_t - H_t + log(alpha)``: > 0 means the token is in the tail."""
    return -logprobs - entropy + math.log(alpha)


def tail_weight(r: Tensor, lam: float) -> Tensor:
    """``(1 - lam) + lam exp(-r)`` where ``r > 0``, 1 elsewhere: TACO's weight of every token."""
    # exp(-r) only matters where r > 0; clamping keeps exp finite on the other tokens
    w = (1.0 - lam) + lam * torch.exp(-r.clamp_min(0.0))
    return torch.where(r > 0, w.clamp_max(1.0), r.new_ones(()))


def ar_lopti_weight(old_logprobs: Tensor, a: float) -> Tensor:
    """``(1 - a) + a p_old``, in [1 - a, 1]."""
    return (1.0 - a) + a * torch.exp(old_logprobs)


def linear_quantile(x: Tensor, q: float) -> Tensor:
    """``torch.quantile(x, q)`` (linear interpolation) of a 1-D tensor, for any size.

    torch.quantile refuses inputs above 2^24 elements; this is its computation (rank
    ``q (n - 1)`` in the input's dtype, ``lerp`` between the neighbouring order statistics)."""
    s = x.sort().values
    rank = torch.tensor(q, dtype=x.dtype, device=x.device) * (s.numel() - 1)
    lo = rank.floor()
    hi = rank.ceil()
    return torch.lerp(s[lo.long()], s[hi.long()], rank - lo)


def stapo_silence(p: Tensor, ent: Tensor, candidates: Tensor, mask: Tensor, config: TACOConfig
                  ) -> Tuple[Tensor, Tensor]:
    """STAPO's silenced tokens ``[B, T]`` and the entropy threshold of each row ``[B]``."""
    rows = candidates.shape[0]
    step = config.stapo_micro_batch_size or max(rows, 1)
    tau = ent.new_zeros(rows)
    for s in range(0, rows, step):
        c, m = candidates[s : s + step], mask[s : s + step]
        source = ent[s : s + step][c] if c.any() else ent[s : s + step][m]
        if source.numel():  # reference: threshold 0.0 when the micro-batch has no valid token
            tau[s : s + step] = linear_quantile(source, config.stapo_entropy_quantile)
    silenced = candidates & (p < config.stapo_prob_threshold) & (ent < tau.unsqueeze(1))
    return silenced, tau


def tampo_truncate(p: Tensor, ent: Tensor, pos: Tensor, config: TACOConfig) -> Tensor:
    """TAMPO's truncated tokens: positive credit with ``p <= p_max`` and ``H <= H_max``."""
    return pos & (p <= config.tampo_prob_threshold) & (ent <= config.tampo_entropy_threshold)


def _mean(x: Tensor, m: Tensor, empty: float) -> float:
    return float(masked_mean(x, m)) if bool(m.any()) else empty


@register_calibrator(
    "taco",
    config=TACOConfig,
    # ar_lopti mode also reads the rollout policy's probability (old_logprobs)
    requires=lambda c: ("logprobs", "entropy") + (("old_logprobs",) if c.mode == "ar_lopti" else ()),
    provenance="ref-code",
    summary="shrinks positive credit on tail tokens (surprisal beyond entropy), never to zero",
    paired_with="grpo",
)
def taco(batch: CreditBatch, advantages: Tensor, config: TACOConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "taco")
    mask = batch.mask
    adv = advantages.detach()
    dt = torch.promote_types(batch.logprobs.dtype, adv.dtype)
    # padding may hold NaN: zero it before any arithmetic so no NaN is ever formed
    logp = masked_fill_zero(batch.logprobs.detach().to(dt), mask)
    ent = masked_fill_zero(batch.entropy.detach().to(dt), mask)
    one, zero = logp.new_ones(()), logp.new_zeros(())
    pos = mask & (adv > 0)
    metrics: Dict[str, float] = {}

    if config.mode == "taco":
        r = tail_risk(logp, ent, config.alpha)
        w_all = tail_weight(r, config.lam)  # the weight every token would get, the reference's metric
        w = torch.where(pos, w_all, one)  # applied to positive credit only
        metrics["taco/tail_risk_mean"] = float(masked_mean(r, mask))
        metrics["taco/tail_token_frac"] = float(masked_mean((r > 0).to(dt), mask))
    elif config.mode == "ar_lopti":
        old = masked_fill_zero(batch.old_logprobs.detach().to(dt), mask)
        w_all = w = ar_lopti_weight(old, config.ar_lopti_alpha)  # every token, A <= 0 included
        metrics["taco/ar_lopti_prob_mean"] = float(masked_mean(torch.exp(old), mask))
    else:
        p = torch.exp(logp)
        if config.mode == "stapo":
            cand = pos if config.stapo_only_positive else mask
            silenced, tau = stapo_silence(p, ent, cand, mask, config)
            metrics["taco/stapo_entropy_threshold"] = float(tau.mean())
            metrics["taco/stapo_candidate_frac"] = _mean(cand.to(dt), mask, 0.0)
            metrics["taco/silenced_candidate_frac"] = _mean(silenced.to(dt), cand, 0.0)
        else:
            cand = pos
            silenced = tampo_truncate(p, ent, pos, config)
            metrics["taco/silenced_candidate_frac"] = _mean(silenced.to(dt), cand, 0.0)
        w_all = w = torch.where(silenced, zero, one)
        # the reference drops these tokens from the token-mean denominator; here they stay in it
        metrics["taco/silenced_token_frac"] = _mean(silenced.to(dt), mask, 0.0)

    changed = w != 1
    out = masked_fill_zero(torch.where(changed, w.to(adv.dtype) * adv, adv), mask)
    # reference metric: the mean weight over all valid tokens (1 outside the tail / not silenced)
    metrics["taco/weight_mean"] = _mean(w_all, mask, 1.0)
    metrics["taco/weight_mean_pos"] = _mean(w, pos, 1.0)
    metrics["taco/positive_adv_token_frac"] = _mean(pos.to(dt), mask, 0.0)
    return CreditOutput(advantages=out, token_weights=masked_fill_zero(w, mask), metrics=metrics)

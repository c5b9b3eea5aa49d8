"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models"): act on the few tokens whose centred product of advantage and
log-probability, the covariance term that drives the policy's entropy down, is largest.

With ``l_t`` the current log-probability, ``A_t`` the advantage, the means over the valid tokens
of the batch the loss sees (one micro-batch, as in verl) and ``r_t = exp(l_t - l_old,t)``::

    cov_t = (A_t - mean A) (l_t - mean l)                                   (both detached)

``clip_cov``: PPO's clipped surrogate, then the gradient of ``max(1, int(clip_cov_ratio N))``
tokens drawn uniformly at random (``torch.randperm`` on the global generator, as verl) among
those with ``clip_cov_lb < cov_t < clip_cov_ub`` that PPO's clip does not already hold, is cut::

    l_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) * (0 if t drawn else 1)

``kl_cov``: no clip; the ``max(1, int(kl_cov_ratio N))`` tokens of largest ``cov_t`` get a
penalty on ``|l_t - l_old,t|``::

    l_t = -A r + ppo_kl_coef |l_t - l_old,t|   if t is among the top-k by cov_t
    l_t = -A r                                  otherwise

``N`` is the number of valid tokens. Defaults are verl's (``actor.policy_loss.clip_cov_ratio``
0.0002, ``clip_cov_lb`` 1, ``clip_cov_ub`` 5, ``kl_cov_ratio`` 0.0002, ``ppo_kl_coef`` 0.1, and
``clip_ratio`` 0.2 on both sides); the authors' recipe (``PRIME-RL/Entropy-Mechanism-of-RL``) uses
``ppo_kl_coef`` 1 and ``kl_cov_ratio`` 0.002 for Qwen2.5-7B. As in verl, the ratio is not clamped
and neither loss has a dual clip. Provenance: **ref-code** (verl ``core_algos.py``
``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``, adapted there from the authors').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .aggregation import aggregate, check_agg_mode
from .policy import check_number, loss_config, prepare_inputs, ratio_metrics, register_policy_loss, valid_mean

__all__ = ["ClipCovLossConfig", "KLCovLossConfig", "clip_cov_loss", "covariance", "kl_cov_loss"]


def covariance(adv: Tensor, lp: Tensor, mask: Tensor) -> Tensor:
    """``(A_t - mean A)(l_t - mean l)`` per token, means over the valid tokens (detached)."""
    n = mask.sum().clamp_min(1).to(lp.dtype)
    a, l = adv.detach(), lp.detach()
    mean_a = torch.where(mask, a, 0.0).sum() / n
    mean_l = torch.where(mask, l, 0.0).sum() / n
    return (a - mean_a) * (l - mean_l)


def _check_ratio(owner: str, field: str, v) -> None:
    check_number(owner, field, v, low=0, low_open=True, high=1, expected="a number in (0, 1]")


# -- clip_cov --------------------------------------------------------------------------------


@dataclass
class ClipCovLossConfig:
    clip_low: float = 0.2  # verl clip_ratio_low
    clip_high: float = 0.2  # verl clip_ratio_high
    clip_cov_ratio: float = 0.0002  # verl policy_loss.clip_cov_ratio: share of the tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # verl policy_loss.clip_cov_lb: the band of covariances drawn from
    clip_cov_ub: float = 5.0  # verl policy_loss.clip_cov_ub
    agg_mode: str = "token-mean"  # verl's default
    norm_constant: Optional[float] = None  # only for seq-mean-token-sum-norm

    def __post_init__(self):
        check_number("clip_cov", "clip_low", self.clip_low, low=0, high=1, high_open=True, expected="a number in [0, 1)")
        check_number("clip_cov", "clip_high", self.clip_high, low=0, expected="a number >= 0")
        _check_ratio("clip_cov", "clip_cov_ratio", self.clip_cov_ratio)
        check_number("clip_cov", "clip_cov_lb", self.clip_cov_lb, expected="a number")
        check_number("clip_cov", "clip_cov_ub", self.clip_cov_ub, low=self.clip_cov_lb, low_open=True,
                      expected=f"a number > clip_cov_lb ({self.clip_cov_lb})")
        check_agg_mode(self.agg_mode, self.norm_constant)


@register_policy_loss(
    "clip_cov",
    config=ClipCovLossConfig,
    provenance="ref-code",
    summary="PPO clip, plus the gradient of a few random tokens in a band of high advantage-logprob covariance cut (Clip-Cov)",
)
def clip_cov_loss(logprobs, old_logprobs, advantages, response_mask, config: Optional[ClipCovLossConfig] = None,
                  loss_weights=None, generator: Optional[torch.Generator] = None) -> Tuple[Tensor, Dict[str, float]]:
    cfg = loss_config("clip_cov", ClipCovLossConfig, config)
    mask, lp, old, adv, w = prepare_inputs(logprobs, old_logprobs, advantages, response_mask, loss_weights)
    log_ratio = lp - old
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    held_by_clip = mask & (clipped > unclipped)
    cov = covariance(adv, lp, mask)
    band = mask & ~held_by_clip & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    n_cut = max(int(cfg.clip_cov_ratio * int(mask.sum())), 1)
    cand = band.nonzero()
    cut = torch.zeros_like(mask)
    if len(cand):
        pick = cand[torch.randperm(len(cand), generator=generator)[: min(n_cut, len(cand))]]
        cut[pick[:, 0], pick[:, 1]] = True
    per_tok = torch.where(cut, 0.0, torch.maximum(unclipped, clipped))
    if w is not None:
        per_tok = per_tok * w
    loss = aggregate(per_tok, mask, cfg.agg_mode, norm_constant=cfg.norm_constant)

    with torch.no_grad():
        n = max(int(mask.sum()), 1)
        metrics = {
            "clip_cov/cov_clip_frac": int(cut.sum()) / n,  # verl's actor/pg_clipfrac for clip_cov
            "clip_cov/band_frac": int(band.sum()) / n,
            "clip_cov/clip_frac": int(held_by_clip.sum()) / n,
            "clip_cov/cov_max": float(cov[mask].max()) if bool(mask.any()) else 0.0,
            **ratio_metrics("clip_cov", log_ratio, ratio, mask),
        }
    return loss, metrics


# -- kl_cov ----------------------------------------------------------------------------------


@dataclass
class KLCovLossConfig:
    kl_cov_ratio: float = 0.0002  # verl policy_loss.kl_cov_ratio: share of the tokens penalised
    ppo_kl_coef: float = 0.1  # verl policy_loss.ppo_kl_coef (the authors' function: 1.0)
    agg_mode: str = "token-mean"  # verl's default
    norm_constant: Optional[float] = None  # only for seq-mean-token-sum-norm

    def __post_init__(self):
        _check_ratio("kl_cov", "kl_cov_ratio", self.kl_cov_ratio)
        check_number("kl_cov", "ppo_kl_coef", self.ppo_kl_coef, low=0, expected="a number >= 0")
        check_agg_mode(self.agg_mode, self.norm_constant)


@register_policy_loss(
    "kl_cov",
    config=KLCovLossConfig,
    provenance="ref-code",
    summary="unclipped surrogate with a |log-ratio| penalty on the top tokens by advantage-logprob covariance (KL-Cov)",
)
def kl_cov_loss(logprobs, old_logprobs, advantages, response_mask, config: Optional[KLCovLossConfig] = None,
                loss_weights=None) -> Tuple[Tensor, Dict[str, float]]:
    cfg = loss_config("kl_cov", KLCovLossConfig, config)
    mask, lp, old, adv, w = prepare_inputs(logprobs, old_logprobs, advantages, response_mask, loss_weights)
    log_ratio = lp - old
    ratio = log_ratio.exp()
    surrogate = -adv * ratio
    cov = covariance(adv, lp, mask)
    n_valid = int(mask.sum())
    top = torch.zeros_like(mask)
    if n_valid:
        k = max(1, int(n_valid * cfg.kl_cov_ratio))
        idx = mask.flatten().nonzero().squeeze(1)[torch.topk(cov[mask], k).indices]
        top.view(-1)[idx] = True
    per_tok = torch.where(top, surrogate + cfg.ppo_kl_coef * log_ratio.abs(), surrogate)
    if w is not None:
        per_tok = per_tok * w
    loss = aggregate(per_tok, mask, cfg.agg_mode, norm_constant=cfg.norm_constant)

    with torch.no_grad():
        metrics = {
            "kl_cov/penalised_frac": int(top.sum()) / max(n_valid, 1),
            "kl_cov/abs_kl": valid_mean(log_ratio.abs(), mask),  # verl's actor/ppo_kl for kl_cov
            "kl_cov/cov_max": float(cov[mask].max()) if n_valid else 0.0,
            **ratio_metrics("kl_cov", log_ratio, ratio, mask),
        }
    return loss, metrics

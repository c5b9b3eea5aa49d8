"""Rollout correction: the policy that sampled (the behaviour policy: a bf16 generation copy, an
inference engine) is not the one the update's old log-probs come from. Named and computed as
verl's ``rollout_correction`` (``trainer/ppo/rollout_corr_helper.py``), with the log-ratio of the
training policy's old log-probs to the behaviour log-probs, on the valid tokens::

    delta_t = l_old,t - l_behaviour,t

* truncated importance sampling (TIS), ``rollout_is``: per-token weights multiplied into the
  policy loss (detached), truncated at ``rollout_is_threshold`` (verl's default 2.0)::

      token:     w_t = min(exp(clamp(delta_t, -20, 20)), threshold)
      sequence:  w_t = min(exp(clamp(sum_t delta_t, -20, 20)), threshold)        (every token of the row)

  ``rollout_is_batch_normalize`` divides the weights by their mean over the batch (tokens, or
  rows for ``sequence``).
* masked importance sampling / rejection (MIS), ``rollout_rs``: tokens (or whole rows) whose
  divergence from the behaviour policy is out of bounds leave the loss (the response mask
  loses them, as verl's). Options, comma-separated (all must pass), one shared
  ``rollout_rs_threshold`` ``u``: ``token_k1`` (keep ``log(1/u) <= -delta_t <= log u``),
  ``token_k2`` (``delta_t^2 / 2 <= u``), ``token_k3`` (``exp(delta_t) - 1 - delta_t <= u``) and
  their row statistics ``seq_sum_k*``, ``seq_mean_k*`` (k1, k2, k3) and ``seq_max_k*`` (k2, k3).

Metrics (every step, whether a correction is on or not), ``rollout_corr/...``: ``log_ratio_mean``,
``log_ratio_max``, ``log_ratio_min`` (of ``delta``), verl's ``kl`` (mean ``-delta``) and ``k3_kl``,
``rollout_is_mean|max|min`` and ``rollout_is_ratio_fraction_high|low`` (with ``rollout_is``),
``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction`` (0 without ``rollout_rs``).
Differences from verl: one threshold for all ``rollout_rs`` options and the k1 bounds symmetric
(verl also takes per-option thresholds and an asymmetric ``"lower_upper"`` string; IcePop's
``"lower_upper"`` ``rollout_is_threshold`` is not offered).
Provenance: **ref-code** (verl ``compute_rollout_correction_and_rejection_mask``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .policy import check_number, valid_mean

__all__ = ["ROLLOUT_IS_LEVELS", "ROLLOUT_RS_OPTIONS", "RolloutCorrectionConfig", "rollout_correction"]

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
SAFETY_BOUND = 20.0  # verl's clamp of the log-ratio before exp


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = None  # None (off) | token | sequence (verl's rollout_is)
    rollout_is_threshold: float = 2.0  # verl's default truncation
    rollout_is_batch_normalize: bool = False  # verl's default
    rollout_rs: Optional[str] = None  # None (off) or comma-separated ROLLOUT_RS_OPTIONS (verl's rollout_rs)
    rollout_rs_threshold: Optional[float] = None  # required with rollout_rs, as in verl

    def __post_init__(self):
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"loss.rollout_is: expected None or one of {list(ROLLOUT_IS_LEVELS)}, got {self.rollout_is!r}")
        check_number("loss", "rollout_is_threshold", self.rollout_is_threshold, low=0, low_open=True,
                      expected="a number > 0")
        if self.rollout_rs is not None:
            opts = self.options
            bad = [o for o in opts if o not in ROLLOUT_RS_OPTIONS]
            if not opts or bad:
                raise ValueError(f"loss.rollout_rs: expected comma-separated options from {list(ROLLOUT_RS_OPTIONS)}, "
                                 f"got {self.rollout_rs!r}")
            if self.rollout_rs_threshold is None:
                raise ValueError(f"loss.rollout_rs_threshold: expected a number > 0 with rollout_rs={self.rollout_rs!r}, got None")
        if self.rollout_rs_threshold is not None:
            check_number("loss", "rollout_rs_threshold", self.rollout_rs_threshold, low=0, low_open=True,
                          expected="a number > 0")
            if any(o.endswith("k1") for o in self.options) and self.rollout_rs_threshold < 1:
                raise ValueError(f"loss.rollout_rs_threshold: expected a number >= 1 with {self.rollout_rs!r} (k1 keeps "
                                 f"the ratio within [1/u, u]), got {self.rollout_rs_threshold!r}")
            if self.rollout_rs is None:
                raise ValueError(f"loss.rollout_rs_threshold: only used with rollout_rs, got {self.rollout_rs_threshold!r} "
                                 f"without it")

    @property
    def options(self) -> Tuple[str, ...]:
        if self.rollout_rs is None:
            return ()
        return tuple(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",") if o.strip()))

    @property
    def active(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


def _row_stat(x: Tensor, mask: Tensor, how: str) -> Tensor:
    if how == "sum":
        return torch.where(mask, x, 0.0).sum(-1)
    if how == "mean":
        return torch.where(mask, x, 0.0).sum(-1) / mask.sum(-1).clamp_min(1)
    m = torch.where(mask, x, -math.inf).max(-1).values
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _keep(option: str, delta: Tensor, mask: Tensor, u: float) -> Tensor:
    """Where option ``option`` keeps a token (a row's statistic is broadcast to its tokens)."""
    level, _, k = option.rpartition("_")
    stat = {"k1": -delta, "k2": 0.5 * delta ** 2, "k3": torch.expm1(delta) - delta}[k]
    if level != "token":
        stat = _row_stat(stat, mask, level.split("_")[1]).unsqueeze(-1).expand_as(delta)
    if k == "k1":
        return (stat >= math.log(1.0 / u)) & (stat <= math.log(u))
    return stat <= u


def rollout_correction(old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor,
                       config: Optional[RolloutCorrectionConfig] = None
                       ) -> Tuple[Optional[Tensor], Tensor, Dict[str, float]]:
    """``(is_weights or None, kept mask, metrics)`` of a batch: the TIS weights (detached, 0 on
    padding) when ``rollout_is`` is set, the response mask less the tokens ``rollout_rs`` rejects,
    and the mismatch metrics (see the module's doc)."""
    cfg = config or RolloutCorrectionConfig()
    mask = response_mask.bool()
    dt = torch.promote_types(old_logprobs.dtype, torch.float32)
    delta = torch.where(mask, old_logprobs.detach().to(dt) - behaviour_logprobs.detach().to(dt), 0.0)
    safe = delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    any_valid = bool(mask.any())
    metrics: Dict[str, float] = {
        "rollout_corr/log_ratio_mean": valid_mean(delta, mask),
        "rollout_corr/log_ratio_max": float(delta[mask].max()) if any_valid else 0.0,
        "rollout_corr/log_ratio_min": float(delta[mask].min()) if any_valid else 0.0,
        "rollout_corr/kl": valid_mean(-delta, mask),
        "rollout_corr/k3_kl": valid_mean(torch.expm1(safe) - safe, mask),
    }

    weights = None
    if cfg.rollout_is is not None:
        if cfg.rollout_is == "token":
            log_w = safe
        else:
            log_w = delta.sum(-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND).expand_as(delta)
        raw = torch.where(mask, log_w.exp(), 0.0)
        weights = raw.clamp(max=cfg.rollout_is_threshold)
        n = max(int(mask.sum()), 1)
        metrics.update({
            "rollout_corr/rollout_is_mean": valid_mean(weights, mask),
            "rollout_corr/rollout_is_max": float(weights[mask].max()) if any_valid else 0.0,
            "rollout_corr/rollout_is_min": float(weights[mask].min()) if any_valid else 0.0,
            "rollout_corr/rollout_is_ratio_fraction_high": int((mask & (raw > cfg.rollout_is_threshold)).sum()) / n,
            "rollout_corr/rollout_is_ratio_fraction_low": int((mask & (raw < 1.0 / cfg.rollout_is_threshold)).sum()) / n,
        })
        if cfg.rollout_is_batch_normalize:
            if cfg.rollout_is == "token":
                norm = valid_mean(weights, mask)
            else:
                rows = mask.any(-1)
                norm = float(weights[:, :1][rows].mean()) if bool(rows.any()) else 0.0
            if norm > 1e-8:
                weights = weights / norm
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = norm if norm > 1e-8 else 1.0

    keep = mask
    for option in cfg.options:
        keep = keep & _keep(option, delta, mask, float(cfg.rollout_rs_threshold))
    n = max(int(mask.sum()), 1)
    rows = mask.any(-1)
    metrics["rollout_corr/rollout_rs_masked_fraction"] = int((mask & ~keep).sum()) / n
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = (
        float((mask & ~keep).any(-1)[rows].float().mean()) if bool(rows.any()) else 0.0)
    return weights, keep, metrics

"""SPO-chain (Guo et al. 2025, ``AIFrameResearch/SPO``): segment advantages from Monte Carlo values
at the response's low-probability tokens, with a probability mask in the loss.

With ``p_t = pi_old(y_t | x, y_{<t})`` the pre-update policy's probability of each sampled token
(at the sampling temperature) and ``theta`` the threshold:

    L          = [t : p_t < theta]                       the low-probability tokens, in order
    S          = L[::interval]                           every interval-th one: the cut points
    segments   [s_j, s_{j+1})  (s_m := T)                one starts at each cut point; the tokens
                                                         before s_0 (all p >= theta) form segment 0
    V_j        = (1/K) sum_i R(y_{<s_j} + c_i),  c_i ~ pi(. | x, y_{<s_j})    the continuation pass
    A_seg j    = V_{j+1} - V_j,   V_m := R               (chain: value at the segment's end minus
                                                          its start; gamma = 1)
    A_t        = A_seg j(t);  0 before s_0 (no value is taken there)
    A_t        = 0                    where p_t > theta
    A          <- (A - mean) / sqrt(var + eps)           whiten: mean and unbiased variance over the
                                                          tokens with p_t < theta (prob_mask; all
                                                          valid tokens where none is, or without it)
    loss       token-mean over the tokens with p_t < theta (prob_mask): here A'_t = A_t N / K on
               them and 0 elsewhere (N valid tokens, K kept), so a token-mean over every valid
               token is the authors' mean over the kept ones (the PPO term is homogeneous in A)

Read in the authors' code (``src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py``:
``_create_value_estimation_requests`` for the cut points, ``_compute_token_advantages`` for the
segment advantages and the zeroing at ``p > 0.9``; ``src/treetune/trainers/ppo_trainer.py``
``_compute_actor_loss`` (``use_prob_mask``: ``action_mask & (exp(old_logprobs) < 0.9)``) and
``src/treetune/trainers/utils.py`` ``masked_whiten`` (its statistics over the same mask)). Defaults
are those of the chain experiment in the README (``configs/polIter_rho1bSft2_spo_chain_GSM8K.jsonnet``
with ``episode_generators/interval5.jsonnet``): threshold 0.9, interval 5, K = 9, the probability
mask on, whitened advantages. Deviations: docs/methods.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import torch

from ..batch import CreditBatch
from ..ops import masked_fill_zero, masked_mean
from ..registry import ContinuationPass, CreditOutput, register_estimator
from .vineppo import step_advantages

__all__ = ["SPOConfig", "ProbabilityCuts", "probability_cuts", "spo"]


@dataclass
class SPOConfig:
    k: int = 9  # continuations per cut point (the chain configs' value_estimation samples: 9; 4 in the qwen configs)
    threshold: float = 0.9  # a token with p < threshold is a cut point candidate, p >= threshold is masked (the code's 0.9)
    interval: int = 5  # every interval-th candidate is a cut point (cutpoint_interval; the README's "int5")
    prob_mask: bool = True  # the loss and the whitening see only the tokens with p < threshold (use_prob_mask)
    whiten: bool = True  # whiten the token advantages (ppo_MATH: whiten_advantages)
    eps: float = 1e-8  # inside the whitening's rsqrt, as masked_whiten

    def __post_init__(self):
        if not (isinstance(self.k, int) and not isinstance(self.k, bool) and self.k >= 1):
            raise ValueError(f"spo k: expected an int >= 1, got {self.k!r}")
        t = self.threshold
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 < t <= 1):
            raise ValueError(f"spo threshold: expected a probability in (0, 1], got {t!r}")
        if not (isinstance(self.interval, int) and not isinstance(self.interval, bool) and self.interval >= 1):
            raise ValueError(f"spo interval: expected an int >= 1, got {self.interval!r}")
        for name in ("prob_mask", "whiten"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"spo {name}: expected a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0):
            raise ValueError(f"spo eps: expected > 0, got {self.eps!r}")


def probability_cuts(logprobs: torch.Tensor, threshold: float, interval: int) -> List[int]:
    """The cut points of one response ``[s_0, s_1, ...]``: every ``interval``-th token whose
    probability ``exp(logprobs)`` is below ``threshold`` (the first such token always)."""
    low = (torch.exp(logprobs.detach().double()) < threshold).nonzero().flatten().tolist()
    return low[::interval]


@dataclass(frozen=True)
class ProbabilityCuts:
    """The continuation pass's cut rule: segment 0 starts at token 0, every other at a cut point of
    :func:`probability_cuts` (a cut point at token 0 is segment 0's start: its value is taken)."""

    threshold: float
    interval: int

    def __call__(self, token_texts: Sequence[str], logprobs=None) -> List[int]:
        if logprobs is None:
            raise ValueError("spo cuts: expected the policy's log-probs of the response (the plan's policy pass), got None")
        if len(logprobs) != len(token_texts):
            raise ValueError(f"spo cuts: expected {len(token_texts)} log-probs (one per token), got {len(logprobs)}")
        return [0] + [s for s in probability_cuts(torch.as_tensor(logprobs), self.threshold, self.interval) if s > 0]


def _continuations(cfg: SPOConfig) -> ContinuationPass:
    return ContinuationPass(cuts=ProbabilityCuts(float(cfg.threshold), cfg.interval), k=cfg.k, max_steps=None,
                            reads_logprobs=True)


@register_estimator(
    "spo",
    config=SPOConfig,
    requires=("logprobs", "mc_values", "step_starts"),
    provenance="ref-code",
    summary="SPO-chain: segments cut at low-probability tokens, A_seg = V(end) - V(start) from K continuations, probability mask",
    loss_defaults={"agg_mode": "token-mean"},
    continuations=_continuations,
)
def spo(batch: CreditBatch, config: SPOConfig) -> CreditOutput:
    m = batch.mask
    p = torch.exp(batch.logprobs.detach().to(torch.float64))
    low = (p < config.threshold) & m
    # A_t = V_{j(t)+1} - V_{j(t)} (V_m = R): the chain of segment values
    a = step_advantages(batch, None)
    # segment 0 before the first cut point has no value of its own: 0 unless token 0 is a cut point
    seg0 = (((batch.step_starts > 0.5) & m).long().cumsum(1) <= 1) & m
    a = torch.where(seg0 & ~low[:, :1], torch.zeros_like(a), a)
    a = torch.where(p > config.threshold, torch.zeros_like(a), a)
    stats = low if (config.prob_mask and bool(low.any())) else m
    if config.whiten:
        n = int(stats.sum())
        mean = masked_mean(a, stats)
        var = masked_mean((a - mean) ** 2, stats) * (n / (n - 1) if n > 1 else 1.0)
        a = (a - mean) * torch.rsqrt(var + config.eps)
    w = None
    if config.prob_mask:
        n_valid, kept = int(m.sum()), int(low.sum())
        w = low.to(a.dtype) * (n_valid / kept if kept else 0.0)
        a = a * w
    starts = (batch.step_starts > 0.5) & m
    return CreditOutput(
        advantages=masked_fill_zero(a, m).to(batch.rewards.dtype),
        token_weights=masked_fill_zero(w, m).to(batch.rewards.dtype) if w is not None else None,
        metrics={
            "spo/segments_mean": float(starts.sum(1).float().mean()) if m.shape[0] else 0.0,
            "spo/kept_frac": float(low.sum()) / max(int(m.sum()), 1),
            "spo/mc_value_mean": masked_mean(batch.mc_values, starts).item() if starts.any() else 0.0,
        },
    )

"""ACPO (Adaptive Credit Policy Optimization): credit from a mode-local surrogate entropy.

    p_t  = max_v pi(v | h_t)                                 mode probability
    Hs_t = -p_t log p_t - (1 - p_t) log(1 - p_t)             binary entropy of mode-vs-rest
    u_t  = Hs_t / log 2                                      uncertainty in [0, 1]
    c_t  = exp(l_t)  if y_t is the mode  else 0              confidence of the sampled token
           (y_t is taken to be the mode when l_t >= log p_t - mode_tol)
    d_b  = sign(sum_t A_t)                                   the rollout's outcome direction
    d_b > 0:  w_t = 1 + beta_pos (u_t - mean_traj u)         uncertain steps of successful rollouts
    d_b < 0:  w_t = 1 + beta_neg (c_t - mean_traj c)         overconfident steps of failed rollouts
    A_t = 0 or d_b = 0:  w_t = 1
    w_t  = clip(w_t, w_min, w_max);   A'_t = w_t A_t

Branch selection (``branch``): the abstract speaks of "successful rollouts" and "failed
rollouts", an outcome of the whole response, so by default (``"rollout"``) the branch is the
rollout's outcome direction, read from its incoming credit as ``sign(sum_t A_t)``: the sign of
the outcome advantage under GRPO / RLOO / Dr. GRPO, and of ``R - V_0`` under estimators whose
credits telescope (OPPO without anchoring, PACT's credit). It is read from the advantages, not
the rewards, because verl's loss-side calibration sees no rewards. ``"token"`` selects by the
sign of each token's own incoming advantage (the earlier reconstruction); the two agree when
every token of a rollout has its outcome's sign (GRPO, OPPO anchored), and differ after an
estimator with per-token signs (``oppo+acpo`` with ``oppo.anchor=off``).

``mean_traj`` is the mean over the trajectory's valid tokens, so before clipping the weights of
a trajectory whose credit has one sign (GRPO) average exactly 1: the trajectory's total credit
is the estimator's, only its distribution over tokens changes.

The surrogate is bounded by the true entropy H (grouping identity, exact):
``Hs <= H <= Hs + (1 - p) log(V - 1)`` (:func:`entropy_bounds`). When the sampled token is the
mode, ``grad Hs = Hs'(p) p grad log pi(y)``: parallel to the policy-gradient direction of the
sampled token, unlike the gradient of the full entropy, which pulls on every logit.

Provenance: **reconstruction**. Only the abstract is available; the surrogate, the bounds and
the asymmetric weights follow its claims as written in docs/methods.md (section ACPO). This is not
presented as the authors' exact algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero, masked_mean, row_mean
from ..registry import CreditOutput, register_calibrator

__all__ = ["ACPOConfig", "acpo", "surrogate_entropy", "entropy_bounds"]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def surrogate_entropy(mode_prob: Tensor) -> Tensor:
    """Binary entropy (nats) of mode vs rest, ``-p log p - (1 - p) log(1 - p)``; 0 at p = 0 or 1.

    Differentiable in ``mode_prob`` (not detached)."""
    p = torch.as_tensor(mode_prob)
    if not p.is_floating_point():
        p = p.to(torch.get_default_dtype())
    return -(torch.special.xlogy(p, p) + torch.special.xlogy(1.0 - p, 1.0 - p))


def entropy_bounds(mode_prob: Tensor, vocab_size: int) -> Tuple[Tensor, Tensor]:
    """Deterministic bounds on the true entropy from the mode probability alone.

    ``H = Hs + (1 - p) H(rest)`` with ``0 <= H(rest) <= log(V - 1)``, so
    ``Hs <= H <= Hs + (1 - p) log(V - 1)``.
    """
    if not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size >= 2):
        raise ValueError(f"vocab_size: expected an int >= 2, got {vocab_size!r}")
    hs = surrogate_entropy(mode_prob)
    p = torch.as_tensor(mode_prob).to(hs.dtype)
    return hs, hs + (1.0 - p) * math.log(vocab_size - 1)


@dataclass
class ACPOConfig:
    # reconstructed: serves "emphasises uncertain decisions in successful rollouts". u - mean u
    # lies in [-1, 1], so beta = 1 lets a fully uncertain fork (u = 1) in a mostly confident
    # trajectory get about twice the mean credit, while confident tokens keep most of theirs
    beta_pos: float = 1.0
    # reconstructed: serves "emphasises overconfident tokens in failed rollouts", the mirror of
    # beta_pos on the sampled token's confidence (c - mean c also in [-1, 1])
    beta_neg: float = 1.0
    # reconstructed: keeps every token's gradient (as TACO does): no weight below 0.1, so a
    # decisive token is damped, never silenced; binds only at the extremes with beta = 1
    w_min: float = 0.1
    # reconstructed: never binds with beta <= 1 (w <= 2); caps larger betas at 2x mean credit
    w_max: float = 2.0
    # reconstructed: log-prob slack when testing "y_t is the mode"; absorbs float rounding
    # between the log-softmax that gives l_t and the softmax max that gives p_t
    mode_tol: float = 1e-3
    # the abstract: "uncertain decisions in successful rollouts ... overconfident tokens in failed
    # rollouts": "rollout" picks the branch by the rollout's outcome direction sign(sum_t A_t);
    # "token" by each token's own advantage sign
    branch: str = "rollout"

    def __post_init__(self):
        if self.branch not in ("rollout", "token"):
            raise ValueError(f"acpo branch: expected 'rollout' or 'token', got {self.branch!r}")
        for name in ("beta_pos", "beta_neg"):
            v = getattr(self, name)
            if not (_is_number(v) and v >= 0.0):
                raise ValueError(f"acpo {name}: expected a finite number >= 0, got {v!r}")
        if not (_is_number(self.w_min) and 0.0 <= self.w_min <= 1.0):
            raise ValueError(f"acpo w_min: expected a number in [0, 1], got {self.w_min!r}")
        if not (_is_number(self.w_max) and self.w_max >= 1.0):
            raise ValueError(f"acpo w_max: expected a finite number >= 1, got {self.w_max!r}")
        if not (_is_number(self.mode_tol) and self.mode_tol >= 0.0):
            raise ValueError(f"acpo mode_tol: expected a finite number >= 0, got {self.mode_tol!r}")


@register_calibrator(
    "acpo",
    config=ACPOConfig,
    requires=("mode_prob", "logprobs"),
    provenance="reconstructed",
    summary="asymmetric mean-1 weights from a mode-local surrogate entropy (uncertainty / confidence)",
    paired_with="grpo",
)
def acpo(batch: CreditBatch, advantages: Tensor, config: ACPOConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "acpo")
    mask = batch.mask
    adv = advantages.detach()
    dt = torch.promote_types(batch.mode_prob.dtype, adv.dtype)
    # padding may hold NaN: replace it before any arithmetic (p = 1 there gives Hs = 0)
    p = torch.where(mask, batch.mode_prob.detach().to(dt), torch.ones((), dtype=dt, device=adv.device))
    logp = masked_fill_zero(batch.logprobs.detach().to(dt), mask)
    hs = surrogate_entropy(p)
    u = hs / math.log(2.0)
    is_mode = mask & (logp >= torch.log(p) - config.mode_tol)
    c = torch.where(is_mode, torch.exp(logp), torch.zeros((), dtype=dt, device=adv.device))
    w_pos = 1.0 + config.beta_pos * (u - row_mean(u, mask))
    w_neg = 1.0 + config.beta_neg * (c - row_mean(c, mask))
    nz = mask & (adv != 0)
    if config.branch == "rollout":
        d = torch.sign(masked_fill_zero(adv, mask).sum(1, keepdim=True))
        pos, neg = nz & (d > 0), nz & (d < 0)
    else:
        pos, neg = mask & (adv > 0), mask & (adv < 0)
    raw = torch.where(pos, w_pos, torch.where(neg, w_neg, torch.ones_like(u)))
    w = raw.clamp(min=config.w_min, max=config.w_max)
    out = masked_fill_zero(w.to(adv.dtype) * adv, mask)
    nz = pos | neg
    n_nz = int(nz.sum())
    metrics = {
        "acpo/weight_mean": float(masked_mean(w, nz)) if n_nz else 1.0,
        "acpo/clip_frac": float(masked_mean((raw != w).to(dt), nz)) if n_nz else 0.0,
        "acpo/surrogate_entropy_mean": float(masked_mean(hs, mask)),
        "acpo/mode_token_frac": float(masked_mean(is_mode.to(dt), mask)),
    }
    return CreditOutput(advantages=out, token_weights=masked_fill_zero(w, mask), metrics=metrics)

"""PACT (Policy Aligned Critic Training): token credit from a critic of the current policy.

Theory (paper): with V(h) = E[R | h] under the current policy, the only token credit that is
complete (credits sum to R - V(h_0)), prefix consistent (a prefix's cumulative credit does not
depend on what follows) and neutral (E[c_t | h_t] = 0) is

    c_t = V(h_{t+1}) - V(h_t)        with V(h_{t_n + 1}) := R after the last valid token t_n

Actor advantage (paper): GAE with gamma = lam = 1, which on each valid token is

    A_t = R - V(h_t)

R is rescaled to [0, 1] by ``reward_range`` and V in (0, 1) is a success probability (the
critic's logit through a sigmoid), trained with BCE against R (:func:`pact_critic_loss`).
The update order is actor first, then critic: after the actor step one more forward of the
updated actor gives pi_new, and each critic token is weighted by a truncated importance ratio
pi_new / pi_old (:func:`pact_critic_is_weights`).

``mode="gae"`` (default) is the GAE recursion of ``gae.py`` with this config's gamma and lam;
``mode="credit"`` is the axiomatic c_t, i.e. the TD errors ``r_t + gamma V_next - V(h_t)``
(the same recursion with lam = 0; with the default gamma = 1 exactly c_t above). Masked
positions inside a response are skipped in both modes, as in GAE.

Provenance: theory, actor advantage, BCE critic and actor-then-critic order are the paper's;
the IS ratio being the local, per-token ratio of the token at t (detached; samples outside the
range masked, not clipped) is the authors' group's public write-up of the paper; only the
truncation range is a **reconstruction** (docs/methods.md, section PACT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..batch import CreditBatch, CreditInputError
from ..ops import masked_fill_zero, masked_mean
from ..registry import CreditOutput, CriticSpec, register_estimator
from .gae import gae_advantages, outcome_token_rewards

__all__ = [
    "PACTConfig",
    "pact",
    "pact_critic_loss",
    "pact_critic_is_weights",
    "rescale_rewards",
    "DEFAULT_IS_LOW",
    "DEFAULT_IS_HIGH",
]

_MODES = ("gae", "credit")

# reconstructed: range of the per-token critic IS ratio pi_new / pi_old. The paper masks samples
# whose ratio falls outside a range but its numbers were not recovered; [1/2, 2] is symmetric in
# log-ratio, always keeps on-policy tokens (ratio 1), and drops tokens whose probability the
# actor step more than doubled or halved (the critic's target no longer describes them).
DEFAULT_IS_LOW = 0.5
DEFAULT_IS_HIGH = 2.0


def _check_range(reward_range) -> Tuple[float, float]:
    try:
        lo, hi = (float(x) for x in reward_range)
    except (TypeError, ValueError):
        raise ValueError(f"pact reward_range: expected a pair (low, high), got {reward_range!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"pact reward_range: expected finite low < high, got {reward_range!r}")
    return lo, hi


def _check_is_range(low, high, where: str) -> None:
    def num(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not (num(low) and 0.0 <= low <= 1.0):
        raise ValueError(f"{where} is_low: expected a number in [0, 1], got {low!r}")
    if not (num(high) and high >= 1.0):
        raise ValueError(f"{where} is_high: expected a finite number >= 1, got {high!r}")


@dataclass
class PACTConfig:
    gamma: float = 1.0  # paper: actor advantage from GAE with gamma = 1
    lam: float = 1.0  # paper: ... and lam = 1, i.e. A_t = R - V(h_t)
    mode: str = "gae"  # paper's actor advantage; "credit" = the axiomatic c_t = V(h_{t+1}) - V(h_t)
    # paper: the critic is a probability trained with BCE against R rescaled to [0, 1]; (0, 1)
    # is the identity for the 0/1 verifier rewards of the paper's tasks
    reward_range: Tuple[float, float] = (0.0, 1.0)
    # critic step (paper: actor first, then the critic on samples weighted by the detached
    # per-token ratio pi_new / pi_old of the updated actor, samples outside [is_low, is_high]
    # masked, not clipped). The range is reconstructed: the paper's numbers were not recovered.
    is_low: float = DEFAULT_IS_LOW
    is_high: float = DEFAULT_IS_HIGH  # upper end of that range (reconstructed, as is_low)

    def __post_init__(self):
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ValueError(f"pact {name}: expected a number in [0, 1], got {v!r}")
        if self.mode not in _MODES:
            raise ValueError(f"pact mode: expected one of {_MODES}, got {self.mode!r}")
        # a list (from YAML) is accepted and stored as a tuple
        self.reward_range = _check_range(self.reward_range)
        _check_is_range(self.is_low, self.is_high, "pact")


def rescale_rewards(rewards: Tensor, reward_range=(0.0, 1.0), *, field: str = "rewards") -> Tensor:
    """``(R - low) / (high - low)`` in [0, 1]; a reward outside ``reward_range`` is an error
    (clipping it would silently give the critic a wrong target)."""
    lo, hi = _check_range(reward_range)
    bad = ~((rewards >= lo) & (rewards <= hi))
    if bad.any():
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise CreditInputError(
            f"{field}: pact expected rewards within reward_range [{lo}, {hi}] (set pact.reward_range "
            f"to the task's reward range), got {rewards[i].item()} at index {i}"
        )
    return (rewards - lo) / (hi - lo)


def _pact_critic(config: PACTConfig) -> CriticSpec:
    """Sigmoid head trained by BCE on R in [0, 1], after the actor, on the updated actor's pass,
    samples weighted by the masked per-token ratio pi_new / pi_old."""

    def loss(head_out, *, rewards, returns, mask, weights):
        return pact_critic_loss(head_out, rewards, mask, weights, reward_range=config.reward_range)

    def is_weights(new_logprobs, old_logprobs, mask):
        return pact_critic_is_weights(new_logprobs, old_logprobs, mask, low=config.is_low, high=config.is_high)

    return CriticSpec(transform="sigmoid", loss=loss, after_actor=True, is_weights=is_weights)


@register_estimator(
    "pact",
    config=PACTConfig,
    requires=("values",),
    critic=_pact_critic,
    provenance="paper",
    summary="critic of the current policy (BCE on R in [0, 1]); advantage R - V(h_t) "
    "(GAE gamma = lam = 1) or token credit V(h_{t+1}) - V(h_t)",
)
def pact(batch: CreditBatch, config: PACTConfig) -> CreditOutput:
    mask = batch.mask
    T = batch.num_positions
    target = rescale_rewards(batch.rewards.detach(), config.reward_range)
    values = batch.values.detach()
    v = values[:, :T]
    out = mask & ((v < 0) | (v > 1))
    if out.any():
        idx = tuple(int(i) for i in out.nonzero()[0])
        raise CreditInputError(
            f"values: pact expects V(h_t) in [0, 1] (a success probability, the sigmoid of the "
            f"critic's logit), got {v[idx].item()} at {idx}"
        )
    r_tok = outcome_token_rewards(target, mask)
    lam = config.lam if config.mode == "gae" else 0.0
    adv = gae_advantages(r_tok, values, mask, config.gamma, lam)

    vf = masked_fill_zero(v.to(adv.dtype), mask)
    # V(h_0) of each non-empty row: the value at its first valid token
    nonempty = mask.any(dim=1)
    first = mask.to(torch.int64).argmax(dim=1)
    v0 = vf.gather(1, first.unsqueeze(1)).squeeze(1)
    err0 = (target.to(adv.dtype) - v0).abs()
    n_rows = int(nonempty.sum())
    return CreditOutput(
        advantages=adv,
        returns=masked_fill_zero(target.unsqueeze(1).expand_as(mask).to(adv.dtype), mask),
        metrics={
            "pact/value_mean": masked_mean(vf, mask).item(),
            "pact/adv_mean": masked_mean(adv, mask).item(),
            "pact/adv_abs_mean": masked_mean(adv.abs(), mask).item(),
            "pact/initial_value_abs_error": (err0[nonempty].sum() / max(n_rows, 1)).item(),
        },
    )


def _bool_mask(mask: Tensor, shape: tuple) -> Tensor:
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(shape):
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise CreditInputError(f"response_mask: expected shape {tuple(shape)}, got {got}")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise CreditInputError("response_mask: expected only 0/1 values")
    return mask.bool()


def pact_critic_loss(
    value_logits: Tensor,
    rewards: Tensor,
    response_mask: Tensor,
    weights: Optional[Tensor] = None,
    *,
    reward_range=(0.0, 1.0),
) -> Tensor:
    """PACT's critic loss: BCE-with-logits of V(h_t) = sigmoid(logit_t) against the rescaled
    outcome on every valid token, weighted token-mean:

        loss = sum_{b,t valid} w_bt * BCE(logit_bt, (R_b - low) / (high - low)) / #valid tokens

    ``value_logits`` [B, T] (differentiable); ``rewards`` [B] within ``reward_range`` (the
    default (0, 1) takes already-rescaled targets as they are); ``weights`` [B, T] >= 0, e.g.
    :func:`pact_critic_is_weights` (detached; 1 when None). The denominator is the number of
    valid tokens, not the sum of weights, so an IS-masked token lowers the loss instead of
    up-weighting the others (verl's token-mean aggregation of IS-weighted losses).
    Returns a scalar; 0 when there is no valid token.
    """
    if not isinstance(value_logits, Tensor) or value_logits.dim() != 2:
        got = tuple(value_logits.shape) if isinstance(value_logits, Tensor) else type(value_logits).__name__
        raise CreditInputError(f"value_logits: expected a tensor of shape [B, T], got {got}")
    B, T = value_logits.shape
    if not isinstance(rewards, Tensor) or tuple(rewards.shape) != (B,):
        got = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise CreditInputError(f"rewards: expected shape ({B},), got {got}")
    mask = _bool_mask(response_mask, (B, T))
    bad = mask & ~torch.isfinite(value_logits.detach())
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CreditInputError(f"value_logits: expected finite values on valid positions, got NaN/inf at {idx}")
    target = rescale_rewards(rewards.detach().to(value_logits.dtype), reward_range)
    if weights is None:
        w = mask.to(value_logits.dtype)
    else:
        if not isinstance(weights, Tensor) or tuple(weights.shape) != (B, T):
            got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
            raise CreditInputError(f"weights: expected shape {(B, T)}, got {got}")
        wd = weights.detach().to(value_logits.dtype)
        badw = mask & ~(torch.isfinite(wd) & (wd >= 0))
        if badw.any():
            idx = tuple(int(i) for i in badw.nonzero()[0])
            raise CreditInputError(f"weights: expected finite values >= 0 on valid positions, got {wd[idx].item()} at {idx}")
        w = masked_fill_zero(wd, mask)
    # padding logits are replaced before the BCE so that a NaN there cannot reach the gradient
    safe_logits = torch.where(mask, value_logits, torch.zeros_like(value_logits))
    bce = F.binary_cross_entropy_with_logits(
        safe_logits, target.unsqueeze(1).expand(B, T), reduction="none"
    )
    return (w * bce).sum() / mask.sum().clamp_min(1).to(value_logits.dtype)


def pact_critic_is_weights(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    response_mask: Tensor,
    *,
    low: float = DEFAULT_IS_LOW,
    high: float = DEFAULT_IS_HIGH,
) -> Tensor:
    """Truncated importance weights for PACT's critic samples [B, T] (detached):

        rho_t = exp(log pi_new(y_t | h_t) - log pi_old(y_t | h_t))
        w_t   = rho_t  if valid and low <= rho_t <= high,  else 0 (masked)

    pi_new is the actor after this step's update, pi_old the behaviour policy of the rollout.
    The local, per-token ratio of the token at t (not the product over the future tokens),
    detached, masking rather than clipping: the authors' group's write-up. **Reconstructed**:
    the range [low, high] (default [0.5, 2]); ``low <= 1 <= high`` so an unchanged token is
    always kept.
    """
    _check_is_range(low, high, "pact_critic_is_weights")
    for name, x in (("new_logprobs", new_logprobs), ("old_logprobs", old_logprobs)):
        if not isinstance(x, Tensor) or x.dim() != 2:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise CreditInputError(f"{name}: expected a tensor of shape [B, T], got {got}")
    if new_logprobs.shape != old_logprobs.shape:
        raise CreditInputError(
            f"old_logprobs: expected shape {tuple(new_logprobs.shape)} (as new_logprobs), got {tuple(old_logprobs.shape)}"
        )
    mask = _bool_mask(response_mask, tuple(new_logprobs.shape))
    dtype = torch.promote_types(new_logprobs.dtype, old_logprobs.dtype)
    diff = new_logprobs.detach().to(dtype) - old_logprobs.detach().to(dtype)
    bad = mask & torch.isnan(diff)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise CreditInputError(f"new_logprobs: expected finite log-prob differences on valid positions, got NaN at {idx}")
    ratio = torch.exp(diff)  # inf for a huge increase: outside the range, so masked below
    keep = mask & (ratio >= low) & (ratio <= high)
    return torch.where(keep, ratio, torch.zeros_like(ratio))

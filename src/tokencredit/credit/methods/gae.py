"""PPO's GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE").

With a critic V (``values[:, t] = V(h_t)``, the state before token t) and the outcome as the
only reward, on each row's valid tokens t_1 < ... < t_n:

    r_t     = R_b  at the last valid token t_n,  0 at every other valid token
    V_next  = V(h_{t_{i+1}})  for t = t_i,  and 0 after the last valid token (terminal)
    delta_t = r_t + gamma * V_next - V(h_t)
    A_t     = sum_{k >= 0} (gamma * lam)^k * delta_{t_{i+k}}
    returns = A_t + V(h_t)                     (the critic's regression target)

Masked positions *inside* a response (multi-turn: tool or environment tokens) are skipped:
the running GAE and the next value are carried across them unchanged, so a hole is not a
step of the recursion (as in verl ``core_algos.compute_gae_advantage_return``). Padding after
the last valid token is skipped the same way, which makes the result invariant to it.

Optionally (``whiten``, the verl default) the advantages are whitened over all valid tokens
of the batch: ``(A - mean) / sqrt(var + eps)``; ``returns`` are taken before whitening.

:func:`gae_advantages` is the recursion alone; PACT reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import masked_fill_zero, masked_mean, masked_sum
from ..registry import CreditOutput, CriticSpec, register_estimator

__all__ = ["GAEConfig", "gae", "gae_advantages", "outcome_token_rewards", "masked_whiten"]


@dataclass
class GAEConfig:
    gamma: float = 1.0  # verl AlgoConfig.gamma (ppo_trainer.yaml algorithm.gamma): no discount
    # verl AlgoConfig / ppo_trainer.yaml algorithm.lam = 1.0: with gamma = 1 and the outcome at
    # the last token, A_t = R - V(h_t) (PACT's actor advantage too). 0.95 is TRL's PPOConfig.lam
    # (classic-control PPO); pass lam=0.95 for it
    lam: float = 1.0
    # verl compute_gae_advantage_return always whitens (masked_whiten over the batch), as do
    # OpenAI's and TRL's PPO; kept as the default so "gae" is the PPO baseline people run
    whiten: bool = True
    whiten_eps: float = 1e-8  # verl_F.masked_whiten: rsqrt(var + 1e-8)

    def __post_init__(self):
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ValueError(f"gae {name}: expected a number in [0, 1], got {v!r}")
        if not isinstance(self.whiten, bool):
            raise ValueError(f"gae whiten: expected a bool, got {self.whiten!r}")
        if not (isinstance(self.whiten_eps, (int, float)) and self.whiten_eps > 0):
            raise ValueError(f"gae whiten_eps: expected a number > 0, got {self.whiten_eps!r}")


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B, T] token rewards: ``R_b`` at the last valid token of row b, 0 elsewhere (and on
    rows without a valid token)."""
    B, T = mask.shape
    pos = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(dim=1).values  # -1: empty row
    at_last = (pos == last.unsqueeze(1)) & mask
    return masked_fill_zero(rewards.unsqueeze(1).expand(B, T), at_last)


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """The GAE recursion over valid tokens, skipping masked positions (holes and padding).

    ``token_rewards`` [B, T]; ``values`` [B, >= T] with ``values[:, t] = V(h_t)`` (only the
    first T columns are read, and only at valid positions; the value after the last valid
    token is 0); ``mask`` [B, T] bool. Returns [B, T] advantages, exactly 0 at masked positions.
    Loops backwards over T, vectorised over B.
    """
    B, T = mask.shape
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    r = token_rewards.detach().to(dtype)
    v = values.detach()[:, :T].to(dtype)
    next_value = r.new_zeros(B)
    running = r.new_zeros(B)
    adv = r.new_zeros(B, T)
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * running
        # torch.where, not arithmetic with the mask: values may be NaN at masked positions
        running = torch.where(m, step, running)
        next_value = torch.where(m, v[:, t], next_value)
        adv[:, t] = torch.where(m, step, torch.zeros_like(step))
    return adv


def masked_whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the valid positions of the whole batch (unbiased
    variance; a single valid token has variance 0), exactly 0 on masked positions."""
    n = int(mask.sum())
    mean = masked_mean(x, mask)
    centred = masked_fill_zero(x - mean, mask)
    var = masked_sum(centred**2, mask) / max(n - 1, 1)
    return centred * torch.rsqrt(var + eps)


def gae_critic_loss(head_out: Tensor, *, rewards: Tensor, returns: Tensor, mask: Tensor, weights=None) -> Tensor:
    """PPO's value loss: token-mean squared error of V(h_t) against the GAE returns A_t + V(h_t)
    (computed with the pre-update values), over valid tokens; ``weights`` (optional) multiply it."""
    m = mask.to(head_out.dtype)
    w = m if weights is None else m * weights.detach().to(head_out.dtype)
    return (w * (head_out - returns.detach().to(head_out.dtype)) ** 2).sum() / m.sum().clamp_min(1)


def _gae_critic(config: "GAEConfig") -> CriticSpec:
    # a plain value head regressed on the returns; its order relative to the actor does not matter
    return CriticSpec(transform="identity", loss=gae_critic_loss)


@register_estimator(
    "gae",
    config=GAEConfig,
    requires=("values",),
    critic=_gae_critic,
    provenance="paper",
    summary="PPO's generalised advantage estimation from a critic, outcome reward at the last token",
)
def gae(batch: CreditBatch, config: GAEConfig) -> CreditOutput:
    mask = batch.mask
    T = batch.num_positions
    r_tok = outcome_token_rewards(batch.rewards.detach(), mask)
    adv = gae_advantages(r_tok, batch.values, mask, config.gamma, config.lam)
    v = masked_fill_zero(batch.values.detach()[:, :T].to(adv.dtype), mask)
    returns = masked_fill_zero(adv + v, mask)
    raw_abs_mean = masked_mean(adv.abs(), mask).item()
    if config.whiten:
        adv = masked_whiten(adv, mask, config.whiten_eps)
    return CreditOutput(
        advantages=adv,
        returns=returns,
        metrics={
            "gae/adv_abs_mean_raw": raw_abs_mean,
            "gae/value_mean": masked_mean(v, mask).item(),
            "gae/returns_mean": masked_mean(returns, mask).item(),
        },
    )

"""Policy losses, registered by name like the credit methods.

Each loss is a pure, differentiable function::

    fn(logprobs, old_logprobs, advantages, response_mask, config, loss_weights=None)
        -> (loss: scalar Tensor, metrics: {"<loss>/<key>": float})

on ``[B, T]`` tensors. Only ``logprobs`` carries gradient; ``old_logprobs``, ``advantages`` and
``loss_weights`` are detached. Padding (mask 0) is never read and may hold NaN; its gradient is
exactly 0. With ``r = exp(l - l_old)`` (log-ratio clamped to ``[-20, 20]`` as in verl) and
optional per-token weights ``w`` multiplying the per-token loss before aggregation:

``ppo`` (clipped surrogate, Schulman et al. 2017; clip-higher from DAPO; dual-clip from
Ye et al. 2020)::

    l_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    l_t = min(l_t, -A c)            if dual_clip = c is set and A < 0   (loss capped at -A c)

``sapo`` (soft gate, Gao et al. 2025, as in verl's ``compute_policy_loss_sapo``)::

    tau = tau_pos if A > 0 else tau_neg
    f(r) = sigmoid(tau (r - 1)) * 4 / tau            df/dr = 4 s (1 - s), s = sigmoid(tau (r - 1))
    l_t = -f(r) A

then ``loss = aggregate(w * l, mask, agg_mode)`` (see :mod:`.aggregation`).

``importance_sampling_level`` (TRL's option; ``ppo`` and ``cispo``): ``"token"`` uses the token
ratio ``r_t``; ``"sequence"`` is GSPO's (Zheng et al. 2025) in its token form, as verl's
``compute_policy_loss_gspo``: ``log s_t = sg[mean_t (l - l_old)] + l_t - sg[l_t]``, whose value is
the sequence's length-normalised ratio ``s = exp(mean_t (l - l_old))`` on every token and whose
gradient is ``s grad l_t`` (so token advantages still weight their own tokens).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..batch import CreditInputError
from ..provenance import PROVENANCE
from ._inputs import as_mask, check_finite, check_tensor, clean, compute_dtype
from .aggregation import aggregate, check_agg_mode

__all__ = [
    "PolicyLossInfo",
    "register_policy_loss",
    "get_policy_loss",
    "list_policy_losses",
    "PPOLossConfig",
    "SAPOLossConfig",
    "ppo_loss",
    "sapo_loss",
    "IS_LEVELS",
    "importance_log_ratio",
    "check_number",
    "loss_config",
    "prepare_inputs",
    "ratio_metrics",
    "valid_mean",
]


# -- registry ------------------------------------------------------------------------------


def loss_config(name: str, cls: type, config: Any) -> Any:
    """The config of loss ``name``: ``cls()`` for None, ``config`` itself, or ``cls(**config)`` for
    a dict (an unknown key is one line naming the loss and the keys it has)."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(f"{name} loss config: unknown key(s) {unknown}; expected some of {sorted(names)}")
        return cls(**config)
    raise TypeError(f"{name} loss config: expected None, a dict or {cls.__name__}, got {type(config).__name__}")


@dataclass(frozen=True)
class PolicyLossInfo:
    """A registered policy loss; calling it builds the config from None / dict / instance."""

    name: str
    fn: Callable[..., Tuple[Tensor, Dict[str, float]]]
    config_cls: type
    provenance: str
    summary: str

    def make_config(self, config: Any = None) -> Any:
        return loss_config(self.name, self.config_cls, config)

    def __call__(self, logprobs, old_logprobs, advantages, response_mask, config=None, loss_weights=None):
        return self.fn(logprobs, old_logprobs, advantages, response_mask, self.make_config(config),
                       loss_weights=loss_weights)


_LOSSES: Dict[str, PolicyLossInfo] = {}


def register_policy_loss(name: str, *, config: type, provenance: str, summary: str) -> Callable:
    """Decorator: register ``fn(logprobs, old_logprobs, advantages, response_mask, config,
    loss_weights=None) -> (loss, metrics)`` as policy loss ``name``."""
    if name in _LOSSES:
        raise ValueError(f"policy loss '{name}' is already registered")
    if provenance not in PROVENANCE:
        raise ValueError(f"{name}: provenance must be one of {PROVENANCE}, got {provenance!r}")
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"{name}: config must be a dataclass")

    def deco(fn: Callable) -> Callable:
        _LOSSES[name] = PolicyLossInfo(name, fn, config, provenance, summary)
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLossInfo:
    try:
        return _LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown policy loss '{name}'; registered: {sorted(_LOSSES)}") from None


def list_policy_losses() -> list:
    return sorted(_LOSSES)


# -- shared pieces -------------------------------------------------------------------------


def prepare_inputs(logprobs, old_logprobs, advantages, response_mask, loss_weights):
    """Check shapes and finiteness; return the mask and the inputs cleaned of padding."""
    if not isinstance(logprobs, Tensor) or logprobs.dim() != 2:
        got = tuple(logprobs.shape) if isinstance(logprobs, Tensor) else type(logprobs).__name__
        raise CreditInputError(f"logprobs: expected a 2-D [B, T] tensor, got {got}")
    shape = logprobs.shape
    check_tensor(old_logprobs, "old_logprobs", shape, "logprobs")
    check_tensor(advantages, "advantages", shape, "logprobs")
    check_tensor(response_mask, "response_mask", shape, "logprobs")
    mask = as_mask(response_mask, shape)
    check_finite(logprobs, mask, "logprobs")
    check_finite(old_logprobs, mask, "old_logprobs")
    check_finite(advantages, mask, "advantages")
    dt = compute_dtype(logprobs)
    w = None
    if loss_weights is not None:
        check_tensor(loss_weights, "loss_weights", shape, "logprobs")
        check_finite(loss_weights, mask, "loss_weights")
        neg = mask & (loss_weights.detach() < 0)
        if neg.any():
            idx = tuple(int(i) for i in neg.nonzero()[0])
            raise CreditInputError(f"loss_weights: expected >= 0 on valid positions, got {loss_weights[idx].item()} at {idx}")
        w = clean(loss_weights.detach(), mask, dt)
    lp = clean(logprobs, mask, dt)
    old = clean(old_logprobs.detach(), mask, dt)
    adv = clean(advantages.detach(), mask, dt)
    return mask, lp, old, adv, w


def valid_mean(x: Tensor, mask: Tensor) -> float:
    """The mean of ``x`` over the valid tokens, in float64, as a number (0 where none is valid):
    a loss's logged metric."""
    n = int(mask.sum())
    return float(torch.where(mask, x.to(torch.float64), 0.0).sum()) / n if n else 0.0


def ratio_metrics(prefix: str, log_ratio: Tensor, ratio: Tensor, mask: Tensor) -> Dict[str, float]:
    """The importance ratio's metrics every policy loss logs under ``prefix``: the KL of the old
    policy to the new (k1 and k3 estimates), and the ratio's mean, max and min."""
    lr, r = log_ratio.detach(), ratio.detach()
    any_valid = bool(mask.any())
    return {
        # k1 estimate of KL(old || new) on old-policy samples (verl's ppo_kl)
        f"{prefix}/ppo_kl": valid_mean(-lr, mask),
        # k3 estimate of the same KL: non-negative, lower variance
        f"{prefix}/approx_kl": valid_mean(r - 1.0 - lr, mask),
        f"{prefix}/ratio_mean": valid_mean(r, mask),
        f"{prefix}/ratio_max": float(r[mask].max()) if any_valid else 0.0,
        f"{prefix}/ratio_min": float(r[mask].min()) if any_valid else 0.0,
    }


def check_number(owner: str, field: str, v, *, low=None, low_open=False, high=None, high_open=False, expected: str):
    """Raise ``ValueError`` (``"<owner> <field>: expected <expected>, got <v>"``) unless ``v`` is a
    finite real number (not a bool) within the bounds (``low`` / ``high``, open or closed)."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        raise ValueError(f"{owner} {field}: expected {expected}, got {v!r}")


#: importance_sampling_level: one ratio per token, or GSPO's one per sequence
IS_LEVELS = ("token", "sequence")


def importance_log_ratio(lp: Tensor, old: Tensor, mask: Tensor, level: str, clamp: float) -> Tensor:
    """The log importance ratio of each valid token (``lp``, ``old`` cleaned of padding): the
    token's ``l - l_old``, or (``"sequence"``) GSPO's ``sg[mean_t (l - l_old)] + l_t - sg[l_t]``;
    clamped to ``[-clamp, clamp]``."""
    log_ratio = lp - old
    if level == "sequence":
        n = mask.sum(-1, keepdim=True).clamp_min(1).to(lp.dtype)
        seq = log_ratio.detach().sum(-1, keepdim=True) / n
        log_ratio = lp - lp.detach() + seq
    return log_ratio.clamp(-clamp, clamp)


def check_is_level(owner: str, level) -> None:
    if level not in IS_LEVELS:
        raise ValueError(f"{owner} importance_sampling_level: expected one of {list(IS_LEVELS)}, got {level!r}")


# -- ppo -----------------------------------------------------------------------------------


@dataclass
class PPOLossConfig:
    clip_low: float = 0.2  # PPO (Schulman et al. 2017) epsilon; DAPO eps_low 0.2
    clip_high: float = 0.2  # symmetric PPO; DAPO clip-higher uses 0.28
    dual_clip: Optional[float] = None  # off; dual-clip PPO (Ye et al. 2020) c = 3 (verl clip_ratio_c 3.0)
    agg_mode: str = "token-mean"  # verl default; DAPO token-level loss
    norm_constant: Optional[float] = None  # only for seq-mean-token-sum-norm; None = padded length T
    log_ratio_clamp: float = 20.0  # verl clamps l - l_old to [-20, 20] before exp
    # TRL's importance_sampling_level: "token" (PPO) or "sequence" (GSPO's ratio; the GSPO paper
    # clips it at 3e-4 / 4e-4 and aggregates seq-mean-token-mean)
    importance_sampling_level: str = "token"

    def __post_init__(self):
        check_is_level("ppo", self.importance_sampling_level)
        check_number("ppo", "clip_low", self.clip_low, low=0, high=1, high_open=True, expected="a number in [0, 1)")
        check_number("ppo", "clip_high", self.clip_high, low=0, expected="a number >= 0")
        if self.dual_clip is not None:
            # c > 1 keeps the cap above the clipped loss at r = 1 (verl asserts the same)
            check_number("ppo", "dual_clip", self.dual_clip, low=1, low_open=True, expected="None or a number > 1")
        check_number("ppo", "log_ratio_clamp", self.log_ratio_clamp, low=0, low_open=True, expected="a number > 0")
        check_agg_mode(self.agg_mode, self.norm_constant)


@register_policy_loss(
    "ppo",
    config=PPOLossConfig,
    provenance="paper",
    summary="clipped surrogate with separate low/high clip (clip-higher) and optional dual-clip",
)
def ppo_loss(logprobs, old_logprobs, advantages, response_mask, config: Optional[PPOLossConfig] = None,
             loss_weights=None) -> Tuple[Tensor, Dict[str, float]]:
    cfg = loss_config("ppo", PPOLossConfig, config)
    mask, lp, old, adv, w = prepare_inputs(logprobs, old_logprobs, advantages, response_mask, loss_weights)
    log_ratio = importance_log_ratio(lp, old, mask, cfg.importance_sampling_level, cfg.log_ratio_clamp)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_tok = torch.maximum(unclipped, clipped)
    neg = adv < 0
    if cfg.dual_clip is not None:
        # for A < 0 the clipped loss grows without bound in r; cap it at -A c
        per_tok = torch.where(neg, torch.minimum(per_tok, -adv * cfg.dual_clip), per_tok)
    if w is not None:
        per_tok = per_tok * w
    loss = aggregate(per_tok, mask, cfg.agg_mode, norm_constant=cfg.norm_constant)

    with torch.no_grad():
        r = ratio.detach()
        high = mask & (adv > 0) & (r > 1.0 + cfg.clip_high)
        low = mask & neg & (r < 1.0 - cfg.clip_low)
        dual = mask & neg & (r > cfg.dual_clip) if cfg.dual_clip is not None else torch.zeros_like(mask)
        n = max(int(mask.sum()), 1)
        metrics = {
            "ppo/clip_frac_high": int(high.sum()) / n,
            "ppo/clip_frac_low": int(low.sum()) / n,
            "ppo/clip_frac": int((high | low).sum()) / n,
            "ppo/dual_clip_frac": int(dual.sum()) / n,
            **ratio_metrics("ppo", log_ratio, ratio, mask),
        }
    return loss, metrics


# -- sapo ----------------------------------------------------------------------------------


@dataclass
class SAPOLossConfig:
    tau_pos: float = 1.0  # SAPO paper / verl policy_loss.tau_pos, gate temperature for A > 0
    tau_neg: float = 1.05  # SAPO paper / verl policy_loss.tau_neg: negative updates decay faster
    agg_mode: str = "seq-mean-token-mean"  # verl hard-codes seq-mean-token-mean for SAPO
    norm_constant: Optional[float] = None  # only for seq-mean-token-sum-norm
    log_ratio_clamp: float = 20.0  # verl clamps l - l_old to [-20, 20] before exp

    def __post_init__(self):
        check_number("sapo", "tau_pos", self.tau_pos, low=0, low_open=True, expected="a number > 0")
        check_number("sapo", "tau_neg", self.tau_neg, low=0, low_open=True, expected="a number > 0")
        check_number("sapo", "log_ratio_clamp", self.log_ratio_clamp, low=0, low_open=True, expected="a number > 0")
        check_agg_mode(self.agg_mode, self.norm_constant)


@register_policy_loss(
    "sapo",
    config=SAPOLossConfig,
    provenance="ref-code",
    summary="soft sigmoid gate on the ratio instead of a hard clip (temperature by sign of A)",
)
def sapo_loss(logprobs, old_logprobs, advantages, response_mask, config: Optional[SAPOLossConfig] = None,
              loss_weights=None) -> Tuple[Tensor, Dict[str, float]]:
    cfg = loss_config("sapo", SAPOLossConfig, config)
    mask, lp, old, adv, w = prepare_inputs(logprobs, old_logprobs, advantages, response_mask, loss_weights)
    log_ratio = (lp - old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = log_ratio.exp()
    tau = torch.where(adv > 0, torch.tensor(cfg.tau_pos, dtype=lp.dtype, device=lp.device),
                      torch.tensor(cfg.tau_neg, dtype=lp.dtype, device=lp.device))
    s = torch.sigmoid(tau * (ratio - 1.0))
    # 4 / tau makes df/dr = 1 at r = 1: on-policy, SAPO's gradient equals the vanilla one
    gate = s * (4.0 / tau)
    per_tok = -gate * adv
    if w is not None:
        per_tok = per_tok * w
    loss = aggregate(per_tok, mask, cfg.agg_mode, norm_constant=cfg.norm_constant)

    with torch.no_grad():
        sd = s.detach()
        metrics = {
            "sapo/gate_mean": valid_mean(gate.detach(), mask),
            # df/dr = 4 s (1 - s): the gradient scale relative to the unclipped surrogate -A r
            "sapo/grad_weight_mean": valid_mean(4.0 * sd * (1.0 - sd), mask),
            **ratio_metrics("sapo", log_ratio, ratio, mask),
        }
    return loss, metrics

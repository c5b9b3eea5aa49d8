"""Losses for the policy update: pure, differentiable torch functions on ``[B, T]`` tensors.

* :func:`aggregate` — token-mean / token-sum / seq-mean-token-mean / seq-mean-token-sum /
  seq-mean-token-sum-norm (Dr. GRPO);
* policy losses by name (:func:`get_policy_loss`): ``ppo`` (clip-higher, dual-clip; GSPO's
  sequence ratio with ``importance_sampling_level="sequence"``), ``sapo``, ``cispo``, and the
  covariance losses ``clip_cov`` and ``kl_cov``;
* :func:`kl_penalty` (k1, k2, k3) and :func:`add_kl_penalty`;
"""

from .aggregation import AGG_MODES, aggregate
from .cispo import CISPOLossConfig, cispo_loss
from .cov import ClipCovLossConfig, KLCovLossConfig, clip_cov_loss, kl_cov_loss
from .kl import KL_KINDS, add_kl_penalty, kl_penalty
from .policy import (
    PolicyLossInfo,
    PPOLossConfig,
    SAPOLossConfig,
    get_policy_loss,
    list_policy_losses,
    ppo_loss,
    register_policy_loss,
    sapo_loss,
)

__all__ = [
    "AGG_MODES",
    "CISPOLossConfig",
    "ClipCovLossConfig",
    "KLCovLossConfig",
    "cispo_loss",
    "clip_cov_loss",
    "kl_cov_loss",
    "KL_KINDS",
    "PPOLossConfig",
    "PolicyLossInfo",
    "SAPOLossConfig",
    "add_kl_penalty",
    "aggregate",
    "get_policy_loss",
    "kl_penalty",
    "list_policy_losses",
    "ppo_loss",
    "register_policy_loss",
    "sapo_loss",
]

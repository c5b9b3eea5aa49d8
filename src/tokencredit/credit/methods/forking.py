"""Forking-token selection ("Beyond the 80/20 rule", Wang et al. 2025): the policy gradient only
on the highest-entropy tokens of the batch.

With ``H_t`` the entropy of the policy's next-token distribution at each valid token and N the
number of valid tokens in the batch::

    K    = max(1, int(rho N + 0.9999))                                 (the authors' ceil)
    F    = the K valid tokens of highest entropy (torch.topk)         selection="topk"
    A'_t = A_t N / K   on F,   0 elsewhere                              renormalize=True

``renormalize`` makes a token-mean loss over all valid tokens equal the authors' loss, which
keeps the tokens of F in the loss mask and averages over them only (``agg_loss`` with
``response_mask * entropy_top_mask``): ``sum_F l / K = sum_F (N / K) l / N``, the per-token PPO
loss being homogeneous in A. Without it the other tokens only lose their gradient (TRL's
``top_entropy_quantile``, which multiplies the per-token loss by the mask and keeps the
denominator). ``selection="quantile"`` is TRL's rule: ``F = {t : H_t >= quantile(H, 1 - rho)}``
(``torch.quantile``, linear interpolation; ties all kept).

Provenance: **ref-code**: ``Shenzhi-Wang/Beyond-the-80-20-Rule-RLVR``
(``verl/trainer/ppo/core_algos.py`` ``get_global_entropy_top_mask``, ``top_ratio`` 0.2, the
mask applied to the loss's aggregation in ``compute_policy_loss``; ``verl/workers/actor/dp_actor.py``:
``entropy_top_ratio``, the entropies of the update's own forward); TRL's ``GRPOTrainer``
(``top_entropy_quantile``, ``get_high_entropy_mask``). The authors select within each update
micro-batch; here within the batch the credit is computed on (the step's batch in the own
trainer and TRL's, the micro-batch in verl's loss), the same when the micro-batch is the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero
from ..registry import CreditOutput, register_calibrator

__all__ = ["ForkingConfig", "forking", "forking_mask", "SELECTIONS"]

#: how the forking tokens are chosen: the authors' top-k count, or TRL's quantile threshold
SELECTIONS = ("topk", "quantile")


@dataclass
class ForkingConfig:
    # the authors' entropy_top_ratio (TRL's top_entropy_quantile): the share of valid tokens kept
    rho: float = 0.2
    # "topk": exactly max(1, ceil(rho N)) tokens (the authors'); "quantile": H >= the (1 - rho) quantile (TRL's)
    selection: str = "topk"
    # scale the kept tokens' credit by N / K, so that a token-mean loss averages over them only (the authors' loss)
    renormalize: bool = True

    def __post_init__(self):
        r = self.rho
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and 0 < r <= 1):
            raise ValueError(f"forking rho: expected a number in (0, 1], got {r!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"forking selection: expected one of {list(SELECTIONS)}, got {self.selection!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"forking renormalize: expected a bool, got {self.renormalize!r}")


def forking_mask(entropy: Tensor, mask: Tensor, rho: float, selection: str = "topk") -> Tensor:
    """Bool [B, T]: the forking tokens among the valid ones (``mask``) of the whole batch."""
    h = entropy.detach()[mask]
    out = torch.zeros_like(mask)
    if h.numel() == 0:
        return out
    if selection == "topk":
        k = max(1, int(h.numel() * rho + 0.9999))  # ceil, as the authors compute it
        keep = torch.zeros(h.numel(), dtype=torch.bool, device=h.device)
        keep[torch.topk(h, k).indices] = True
    else:
        keep = h >= torch.quantile(h.float(), 1.0 - rho).to(h.dtype)
    out[mask] = keep
    return out


@register_calibrator(
    "forking",
    config=ForkingConfig,
    requires=("entropy",),
    provenance="ref-code",
    summary="credit only on the top-rho entropy ('forking') tokens of the batch, renormalised as the authors' loss",
    paired_with="grpo",
)
def forking(batch: CreditBatch, advantages: Tensor, config: ForkingConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "forking")
    m = batch.mask
    adv = masked_fill_zero(advantages.detach(), m)
    keep = forking_mask(batch.entropy, m, config.rho, config.selection)
    n, k = int(m.sum()), int(keep.sum())
    scale = n / k if (config.renormalize and k) else 1.0
    w = keep.to(adv.dtype) * scale
    return CreditOutput(
        advantages=masked_fill_zero(adv * w, m),
        token_weights=masked_fill_zero(w, m),
        metrics={
            "forking/kept_frac": k / n if n else 0.0,
            "forking/scale": float(scale),
            "forking/entropy_threshold": float(batch.entropy.detach()[keep].min()) if k else 0.0,
        },
    )

"""GTPO (Tan et al. 2025, "GTPO and GRPO-S: token and sequence-level reward shaping with policy
entropy"): entropy-weighted token rewards, normalised separately for successes and failures.

Within a group, O+ = responses with R > success_threshold and O- = the rest. At position t,
d_t (h_t) counts the O+ (O-) responses of the group that have a valid token at t, and
H~ = max(H, 0) + eps guards a zero entropy:

    O+:  r_{i,t} =  a1 R_i + a2 * (H~_{i,t}     / sum_{k in O+, alive at t} H~_{k,t})     * d_t
    O-:  r_{j,t} = -a1     - a2 * ((1/H~_{j,t}) / sum_{k in O-, alive at t} (1/H~_{k,t})) * h_t

The entropy shares at each position sum to 1 over the alive responses of the set, so the bonus
averages a2 per alive token: an O+ token with more entropy than its peers gets more credit
(exploration at pivotal, uncertain steps), an O- token with less entropy gets more blame
(confident mistakes). The entropy is detached.

Advantages are then normalised separately within O+ and within O- of each group
(``normalize``):

    "mean"   (default)  A = r / mean_{tokens of the set in the group} |r|
    "zscore"            A = (r - mean_set r) / (std_set r + norm_eps)
    "none"              A = r

The paper normalises the two sets separately. Its equation was out of our reach (only the
abstract and introduction); two public third-party implementations read it as a z-score over
all the token rewards of the set, each token counted once: textpolicy
(``normalize_gtpo_advantages``, "Eq. 6", population std over the set) and a verl fork
(``compute_gtpo_advantage``: ``masked_whiten`` over all O+ tokens of the batch, then all O-
tokens). "zscore" is that reading, per group (the set of a group's O+ / O- tokens, as the
shaping's sums are per group). It is not the default, deliberately: with binary rewards every
O+ token shares ``a1 R = a1``, so the z-score removes the outcome term entirely; what is left
is the entropy bonus centred to mean 0 within each set (measured, docs/methods.md: 42% of O+
tokens get negative credit, 50% of O- tokens positive, correlation with GRPO's token credit
0.00). "mean" (default, ours) divides by the set's mean |r|: every O+ token stays positive,
every O- token negative (mean +1 and -1 per set and group), as the shaping intends.

A group whose responses all fall in one set has no success/failure contrast. With
``skip_single_outcome_groups`` (default) it gets 0 credit, as GRPO gives an all-equal group
(and as DAPO-style dynamic sampling, GTPO's baseline recipe, drops such groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import Groups, groups_of, masked_fill_zero, masked_mean
from ..registry import CreditOutput, register_estimator

__all__ = ["GTPOConfig", "gtpo"]


@dataclass
class GTPOConfig:
    # paper: O+ = correct responses; with rewards in {0, 1} any threshold in [0, 1) splits them.
    # Must be >= 0 so that every O+ reward, and so every O+ token reward, is positive.
    success_threshold: float = 0.5
    a1: float = 1.0  # paper (docs/methods.md): weight of the outcome term
    a2: float = 0.1  # paper (docs/methods.md): weight of the entropy-shaped term
    # paper: guard H ~ 0 in the ratios; 1e-6 bounds 1/H~ at 1e6, safe in float32
    eps: float = 1e-6
    # ours, deliberately not the paper's z-score (as two public implementations read it): the
    # z-score drops the outcome term a1 R with binary rewards (module docstring, docs/methods.md)
    normalize: str = "mean"
    # zscore only: added to the population std, as GRPO's eps (verl 1e-6)
    norm_eps: float = 1e-6
    # ours: no success/failure contrast in the group -> 0 credit, as under GRPO
    skip_single_outcome_groups: bool = True

    def __post_init__(self):
        t = self.success_threshold
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"gtpo success_threshold: expected a finite number >= 0, got {t!r}")
        for name in ("a1", "a2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"gtpo {name}: expected a finite number >= 0, got {v!r}")
        if not self.a1 + self.a2 > 0:
            raise ValueError(f"gtpo a1 + a2: expected > 0 (some reward), got a1={self.a1}, a2={self.a2}")
        for name in ("eps", "norm_eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"gtpo {name}: expected a finite number > 0, got {v!r}")
        if self.normalize not in ("mean", "zscore", "none"):
            raise ValueError(f"gtpo normalize: expected 'mean', 'zscore' or 'none', got {self.normalize!r}")
        if not isinstance(self.skip_single_outcome_groups, bool):
            raise ValueError(
                f"gtpo skip_single_outcome_groups: expected a bool, got {self.skip_single_outcome_groups!r}"
            )


def _group_sum(x: Tensor, g: Groups) -> Tensor:
    """Sum of rows of ``x`` [B, ...] within each group, broadcast back to [B, ...]."""
    s = torch.zeros((g.n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, g.index, x)
    return s[g.index]


def _share(x: Tensor, alive: Tensor, g: Groups) -> tuple:
    """x's share of the column sum over the alive rows of its group, and the alive count."""
    xa = masked_fill_zero(x, alive)
    total = _group_sum(xa, g)
    count = _group_sum(alive.to(x.dtype), g)
    share = xa / torch.where(alive, total, torch.ones_like(total))
    return masked_fill_zero(share, alive), count


def _normalize_within(r: Tensor, member: Tensor, g: Groups, how: str, norm_eps: float) -> Tensor:
    """Normalise the token rewards of ``member`` tokens [B, T] within each group."""
    if how == "none":
        return masked_fill_zero(r, member)
    fm = member.to(r.dtype)
    n = _group_sum(fm.sum(1), g).clamp_min(1.0).unsqueeze(1)
    if how == "mean":
        scale = _group_sum(masked_fill_zero(r.abs(), member).sum(1), g).unsqueeze(1) / n
        # |r| >= a2 * share * count > 0 or a1 > 0 on every member token, so scale > 0 where used
        out = r / torch.where(scale > 0, scale, torch.ones_like(scale))
    else:
        mu = _group_sum(masked_fill_zero(r, member).sum(1), g).unsqueeze(1) / n
        var = _group_sum(masked_fill_zero((r - mu) ** 2, member).sum(1), g).unsqueeze(1) / n
        out = (r - mu) / (var.sqrt() + norm_eps)
    return masked_fill_zero(out, member)


@register_estimator(
    "gtpo",
    config=GTPOConfig,
    requires=("entropy",),
    provenance="paper",
    summary="entropy-weighted token rewards for correct (high H) and wrong (low H) responses, normalised per set",
    needs_groups=True,
)
def gtpo(batch: CreditBatch, config: GTPOConfig) -> CreditOutput:
    g = groups_of(batch, "gtpo")
    m = batch.mask
    out_dt = torch.promote_types(batch.rewards.dtype, batch.entropy.dtype)
    # float64 where the device has it (MPS does not): z-scoring a set of equal token rewards
    # divides rounding residue by norm_eps, visible in float32
    dt = torch.float32 if m.device.type == "mps" else torch.float64
    r = batch.rewards.detach().to(dt)
    # a full-vocabulary entropy is >= 0; clamping only removes rounding below 0
    h = masked_fill_zero(batch.entropy.detach().to(dt), m).clamp_min(0.0) + config.eps

    is_pos = r > config.success_threshold
    alive_pos = m & is_pos.unsqueeze(1)
    alive_neg = m & ~is_pos.unsqueeze(1)

    share_pos, d = _share(h, alive_pos, g)
    share_neg, hcount = _share(1.0 / h, alive_neg, g)
    bonus_pos = share_pos * d
    bonus_neg = share_neg * hcount
    r_pos = config.a1 * r.unsqueeze(1) + config.a2 * bonus_pos
    r_neg = -config.a1 - config.a2 * bonus_neg

    adv = _normalize_within(r_pos, alive_pos, g, config.normalize, config.norm_eps) + _normalize_within(
        r_neg, alive_neg, g, config.normalize, config.norm_eps
    )

    n_pos = _group_sum(is_pos.to(dt), g)
    single = (n_pos == 0) | (n_pos == g.counts.to(dt)[g.index])
    if config.skip_single_outcome_groups:
        adv = torch.where(single.unsqueeze(1), torch.zeros_like(adv), adv)
    adv = masked_fill_zero(adv, m).to(out_dt)

    live = ~single.unsqueeze(1) if config.skip_single_outcome_groups else torch.ones_like(m)
    metrics = {
        "gtpo/pos_frac": is_pos.to(dt).mean().item(),
        "gtpo/single_outcome_group_frac": (single.to(dt) / g.counts.to(dt)[g.index]).sum().item() / g.n,
        "gtpo/pos_adv_mean": masked_mean(adv, alive_pos & live).item(),
        "gtpo/neg_adv_mean": masked_mean(adv, alive_neg & live).item(),
        # the bonus share * count averages 1 over alive tokens; its max shows how strongly
        # entropy redistributes the a2 term
        "gtpo/bonus_max_pos": (bonus_pos.max().item() if bool(alive_pos.any()) else 0.0),
        "gtpo/bonus_max_neg": (bonus_neg.max().item() if bool(alive_neg.any()) else 0.0),
    }
    return CreditOutput(advantages=adv, metrics=metrics)

"""STARE (Surprisal-guided Token-level Advantage Reweighting for policy Entropy stability).

    T+ = valid tokens with A > 0,   T- = valid tokens with A < 0,   s_t = -l_t (detached)
    L+ = the top k(|T+|) tokens of T+ by s,  k(n) = ceil(P n), at least 1 when n > 0
    L- = likewise in T-                                           (variant "C2" only)
    gate  = 1[ Hbar < H_target ],  Hbar = mean entropy over the valid tokens of the batch
    omega = W on L+, M on L- (C2), 1 elsewhere;  omega = 1 everywhere when the gate is off
    A'_t  = omega_t * A_t

Why these tokens (paper): to first order a token's update changes the policy entropy by its
advantage times an entropy-sensitivity function, and that sensitivity is largest for surprising
tokens. High-surprisal tokens with A > 0 raise entropy, with A < 0 lower it. Scaling the former
up by W > 1 (and the latter down by M < 1) pushes entropy up; the gate applies it only while the
entropy is below the target band, so it is a closed-loop regulator rather than a constant bias.

Selection scope: ``selection="batch"`` (default) ranks over the whole batch passed in, the
step's rollout batch, so the selected set does not depend on how the trainer splits it. The
reference code ranks per micro-batch (``selection="micro_batch"``: consecutive chunks of
``micro_batch_size`` rows), which makes the result depend on the micro-batch size; it is kept
for reproducing the reference. Ties in surprisal are broken deterministically: among equal
surprisals the earlier token (by row, then position) is selected first.

The adaptive schedule is state (:class:`StareController`), stepped once per optimisation step
from the step's batch, before-update entropy:

    W <- clip(W + a sgn(H_target - Hbar), 1, w_max)
    M <- clip(M - a sgn(H_target - Hbar), m_min, 1)        (only with adaptive=True)

Provenance: reference code (hp-luo/STARE, a verl 0.7 fork), summarised in docs/methods.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero, masked_mean
from ..registry import CreditOutput, register_calibrator

__all__ = ["StareConfig", "StareController", "stare", "select_top_surprisal", "top_count", "VARIANTS", "SELECTIONS"]

VARIANTS = ("O1", "C2")
SELECTIONS = ("batch", "micro_batch")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class StareConfig:
    variant: str = "O1"  # reference default: reweight L+ only; "C2" also scales L- by M
    P: float = 0.1  # reference default: top 10% by surprisal
    W: float = 1.1  # reference default weight on L+
    M: float = 0.9  # reference default weight on L- (C2)
    H_target: float = 0.3  # reference default target entropy (nats, token mean)
    adaptive: bool = False  # reference default: fixed W, M
    a: float = 0.01  # reference default step of the adaptive schedule
    w_max: float = 1.5  # reference default upper clip of W
    m_min: float = 0.5  # reference default lower clip of M
    # ours: rank over the whole step batch (independent of the micro-batch split);
    # "micro_batch" reproduces the reference's per-micro-batch ranking
    selection: str = "batch"
    micro_batch_size: Optional[int] = None  # rows per chunk; required with selection="micro_batch"

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"stare variant: expected one of {VARIANTS}, got {self.variant!r}")
        if not (_is_number(self.P) and 0.0 < self.P <= 1.0):
            raise ValueError(f"stare P: expected a fraction in (0, 1], got {self.P!r}")
        if not (_is_number(self.w_max) and self.w_max >= 1.0):
            raise ValueError(f"stare w_max: expected a finite number >= 1, got {self.w_max!r}")
        if not (_is_number(self.m_min) and 0.0 < self.m_min <= 1.0):
            raise ValueError(f"stare m_min: expected a number in (0, 1], got {self.m_min!r}")
        # W and M start inside the range the schedule keeps them in
        if not (_is_number(self.W) and 1.0 <= self.W <= self.w_max):
            raise ValueError(f"stare W: expected a number in [1, w_max={self.w_max}], got {self.W!r}")
        if not (_is_number(self.M) and self.m_min <= self.M <= 1.0):
            raise ValueError(f"stare M: expected a number in [m_min={self.m_min}, 1], got {self.M!r}")
        if not (_is_number(self.H_target) and self.H_target >= 0.0):
            raise ValueError(f"stare H_target: expected a finite number >= 0, got {self.H_target!r}")
        if not (_is_number(self.a) and self.a >= 0.0):
            raise ValueError(f"stare a: expected a finite number >= 0, got {self.a!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"stare adaptive: expected a bool, got {self.adaptive!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"stare selection: expected one of {SELECTIONS}, got {self.selection!r}")
        mbs = self.micro_batch_size
        if mbs is not None and not (isinstance(mbs, int) and not isinstance(mbs, bool) and mbs >= 1):
            raise ValueError(f"stare micro_batch_size: expected None or an int >= 1, got {mbs!r}")
        if self.selection == "micro_batch" and mbs is None:
            raise ValueError("stare micro_batch_size: expected an int >= 1 with selection='micro_batch', got None")


def top_count(P: float, n: Tensor) -> Tensor:
    """``k(n) = ceil(P n)``, at least 1 when ``n > 0``.

    ``P n`` is rounded to 9 decimals first, so that a float product that should be an integer
    (``0.07 * 100 = 7.000000000000001``) is not rounded up to the next one.
    """
    k = torch.ceil(torch.round(n.to(torch.float64) * P, decimals=9)).to(n.dtype)
    return torch.where(n > 0, k.clamp_min(1), torch.zeros_like(k)).minimum(n)


def select_top_surprisal(surprisal: Tensor, candidates: Tensor, P: float, chunk_rows: int) -> Tensor:
    """Bool [B, T]: within each chunk of ``chunk_rows`` consecutive rows, the ``top_count(P, n)``
    candidates of largest surprisal (n = candidates in the chunk). Ties: earlier (row, position)
    first. Non-candidate positions are never read."""
    B, T = candidates.shape
    C = -(-B // chunk_rows)
    extra = C * chunk_rows - B
    key = torch.where(candidates, surprisal, surprisal.new_full((), -math.inf))
    cand = candidates
    if extra:
        key = torch.cat([key, key.new_full((extra, T), -math.inf)])
        cand = torch.cat([cand, cand.new_zeros((extra, T))])
    key = key.reshape(C, chunk_rows * T)
    cand = cand.reshape(C, chunk_rows * T)
    # a stable descending sort keeps equal keys in flat (row, position) order; padding columns
    # appended to every row do not change that order among real tokens
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    k = top_count(P, cand.sum(dim=1))
    sel = cand & (rank < k.unsqueeze(1))
    return sel.reshape(C * chunk_rows, T)[:B]


def batch_entropy_mean(batch: CreditBatch) -> float:
    """Hbar: token-mean entropy over the valid tokens of the batch (0 when there are none)."""
    ent = batch.entropy.detach().to(torch.float64)
    return float(masked_mean(masked_fill_zero(ent, batch.mask), batch.mask))


def _sgn(x: float) -> float:
    return float((x > 0) - (x < 0))


class StareController:
    """STARE's checkpointed state: the weights W, M and the number of controller steps.

    ``update(batch)`` is one step of the adaptive schedule (a no-op on W, M unless
    ``config.adaptive``); call it once per optimisation step with the step's batch, whose
    entropy is measured before the update.
    """

    #: the signals ``update`` reads (``CreditPipeline.state_signals``: what a trainer hands it)
    requires = ("entropy",)

    def __init__(self, config: StareConfig):
        if not isinstance(config, StareConfig):
            raise TypeError(f"config: expected a StareConfig, got {type(config).__name__}")
        self.config = config
        self.W = float(config.W)
        self.M = float(config.M)
        self.step = 0

    def update(self, batch: CreditBatch) -> Dict[str, float]:
        batch.require("stare", ["entropy"])
        c = self.config
        h = batch_entropy_mean(batch)
        if c.adaptive:
            d = _sgn(c.H_target - h)
            self.W = min(max(self.W + c.a * d, 1.0), c.w_max)
            self.M = min(max(self.M - c.a * d, c.m_min), 1.0)
        self.step += 1
        return {
            "stare/W_next": self.W,
            "stare/M_next": self.M,
            "stare/controller_step": float(self.step),
        }

    def state_dict(self) -> Dict[str, object]:
        return {"W": float(self.W), "M": float(self.M), "step": int(self.step)}

    def load_state_dict(self, d: Dict[str, object]) -> None:
        if not isinstance(d, dict) or set(d) != {"W", "M", "step"}:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise KeyError(f"stare state: expected keys ['M', 'W', 'step'], got {got}")
        for key in ("W", "M"):
            if not _is_number(d[key]) or not d[key] > 0:
                raise ValueError(f"stare state {key}: expected a finite number > 0, got {d[key]!r}")
        step = d["step"]
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            raise ValueError(f"stare state step: expected an int >= 0, got {step!r}")
        self.W, self.M, self.step = float(d["W"]), float(d["M"]), int(step)


@register_calibrator(
    "stare",
    config=StareConfig,
    requires=("logprobs", "entropy"),
    provenance="ref-code",
    summary="entropy-gated reweighting of the most surprising tokens (top-P by surprisal)",
    paired_with="grpo",
    state_cls=StareController,
)
def stare(batch: CreditBatch, advantages: Tensor, config: StareConfig, state: Optional[StareController] = None) -> CreditOutput:
    check_advantages(batch, advantages, "stare")
    mask = batch.mask
    adv = advantages.detach()
    W, M = (state.W, state.M) if state is not None else (float(config.W), float(config.M))
    s = masked_fill_zero(-batch.logprobs.detach(), mask)
    chunk = batch.batch_size if config.selection == "batch" else config.micro_batch_size
    pos = mask & (adv > 0)
    neg = mask & (adv < 0)
    sel_pos = select_top_surprisal(s, pos, config.P, chunk)
    if config.variant == "C2":
        sel_neg = select_top_surprisal(s, neg, config.P, chunk)
    else:
        sel_neg = torch.zeros_like(mask)
    h = batch_entropy_mean(batch)
    gate = h < config.H_target
    omega = adv.new_ones(adv.shape)
    if gate:
        omega = torch.where(sel_pos, adv.new_full((), W), omega)
        omega = torch.where(sel_neg, adv.new_full((), M), omega)
    out = masked_fill_zero(omega * adv, mask)
    n_valid = max(int(mask.sum()), 1)
    metrics = {
        "stare/gate": 1.0 if gate else 0.0,
        "stare/W": float(W),
        "stare/M": float(M),
        "stare/entropy_mean": h,
        # candidate sets, reported whether or not the gate applied them (fraction of valid tokens)
        "stare/selected_pos_frac": int(sel_pos.sum()) / n_valid,
        "stare/selected_neg_frac": int(sel_neg.sum()) / n_valid,
    }
    return CreditOutput(advantages=out, token_weights=masked_fill_zero(omega, mask), metrics=metrics)

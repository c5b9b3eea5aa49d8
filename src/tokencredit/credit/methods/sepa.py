"""SEPA (selective entropy pooling) with retrain's GTPO surprisal weighting.

Per response, from the surprisal of each sampled token ``s_t = min(-log pi(y_t), 50)``:

    mu_exec = mean of s over the execution tokens (planning_mask = 0)
    s'_t    = s_t                                  planning tokens
    s'_t    = lam mu_exec + (1 - lam) s_t          execution tokens (pooled toward their mean)
    w_t     = max(0, 1 + beta (s'_t / (mean_t s' + 1e-8) - 1))     (w = 1 when mean s' < 1e-7)
    A'_t    = w_t A_t

so that after pooling the GTPO weight separates planning tokens from the (flattened) execution
tokens. ``lam`` follows a controller (:class:`SEPAController`) in retrain's order: at step k
(0-based, counting the controller's updates) the step's ``lam`` is resolved *before* step k's
correct rate is observed,

    lam_k = clip((k - delay_steps) / steps, 0, 1)   if the gate is open after steps 0 .. k-1
          = 0                                        otherwise

then the gate observes step k's share of correct responses (``R > correct_threshold``, retrain's
``CORRECT_THRESHOLD`` 0.5) and opens for good once it reaches ``correct_rate_gate``. The pipeline
steps the controller before the credit, so :meth:`SEPAController.update` records ``lam_k`` first
and the credit reads it (:meth:`SEPAController.lam`). ``lam`` (config) fixes it instead.

Provenance: **ref-code**: ``teilomillet/retrain`` (``retrain/advantages/credit.py``:
``apply_sepa_pooling`` and ``apply_gtpo_weighting``; ``retrain/advantages/pipeline.py``: pooling,
then GTPO weighting; ``retrain/training/sepa.py``: the linear schedule and the correctness gate;
defaults from ``retrain/config/schema.py``: beta 0.1, 500 steps, delay 50, gate 0.1). retrain's
``auto`` schedule (execution-entropy variance decay) is not implemented. The planning mask is
HICRA's (:mod:`tokencredit.credit.planning`), computed by the own trainer and TRL's from the decoded
response tokens; verl's integration refuses a spec that reads it.
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

__all__ = ["SEPAConfig", "SEPAController", "sepa", "pooled_surprisal", "MAX_SURPRISAL"]

#: retrain's cap on a token's surprisal (advantages/constants.py)
MAX_SURPRISAL = 50.0


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SEPAConfig:
    # retrain's gtpo_beta: the surprisal weight's slope
    beta: float = 0.1
    # retrain's sepa_steps: the pooling strength ramps from 0 to 1 over this many steps
    steps: int = 500
    # retrain's sepa_delay_steps: steps before the ramp starts
    delay_steps: int = 50
    # retrain's sepa_correct_rate_gate: pooling stays off until a step's share of correct responses reaches it
    correct_rate_gate: float = 0.1
    # a response counts as correct for the gate when R > this (retrain's CORRECT_THRESHOLD, training/signals.py)
    correct_threshold: float = 0.5
    # a fixed pooling strength in [0, 1] instead of the schedule (None: the schedule)
    lam: Optional[float] = None

    def __post_init__(self):
        if not (_num(self.beta) and self.beta >= 0):
            raise ValueError(f"sepa beta: expected a finite number >= 0, got {self.beta!r}")
        for name in ("steps", "delay_steps"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise ValueError(f"sepa {name}: expected an int >= 0, got {v!r}")
        if not (_num(self.correct_rate_gate) and 0 <= self.correct_rate_gate <= 1):
            raise ValueError(f"sepa correct_rate_gate: expected a number in [0, 1], got {self.correct_rate_gate!r}")
        if not _num(self.correct_threshold):
            raise ValueError(f"sepa correct_threshold: expected a finite number, got {self.correct_threshold!r}")
        if self.lam is not None and not (_num(self.lam) and 0 <= self.lam <= 1):
            raise ValueError(f"sepa lam: expected None or a number in [0, 1], got {self.lam!r}")


class SEPAController:
    """SEPA's checkpointed state: the number of steps taken, the correctness gate, and the
    pooling strength resolved for the last step (the one its credit used)."""

    #: the signals ``update`` reads beyond the mask and rewards (``CreditPipeline.state_signals``)
    requires = ()

    def __init__(self, config: SEPAConfig):
        if not isinstance(config, SEPAConfig):
            raise TypeError(f"config: expected a SEPAConfig, got {type(config).__name__}")
        self.config = config
        self.step = 0
        self.gate_open = config.correct_rate_gate <= 0
        self.current = self.resolve(0)

    def resolve(self, step: int) -> float:
        """retrain's ``resolve_lambda(step)`` with the gate as it is now."""
        c = self.config
        if c.lam is not None:
            return float(c.lam)
        if not self.gate_open or c.steps <= 0:
            return 0.0
        return min(max((step - c.delay_steps) / c.steps, 0.0), 1.0)

    def lam(self) -> float:
        """The pooling strength of the current step (resolved by the last :meth:`update`)."""
        return self.current

    def update(self, batch: CreditBatch) -> Dict[str, float]:
        # retrain's order: resolve this step's lambda, then observe this step's correct rate
        self.current = self.resolve(self.step)
        rows = batch.mask.any(1)
        if not self.gate_open and bool(rows.any()):
            rate = float((batch.rewards[rows] > self.config.correct_threshold).double().mean())
            self.gate_open = rate >= self.config.correct_rate_gate
        self.step += 1
        return {"sepa/lambda_next": self.resolve(self.step), "sepa/controller_step": float(self.step)}

    def state_dict(self) -> Dict[str, object]:
        return {"step": int(self.step), "gate_open": bool(self.gate_open), "lam": float(self.current)}

    def load_state_dict(self, d: Dict[str, object]) -> None:
        # {"step", "gate_open"}: a state saved before "lam" was recorded (that controller resolved
        # lambda after observing the step, at the incremented step: resolve(step) gives it again)
        keys = {"step", "gate_open", "lam"}
        if not isinstance(d, dict) or set(d) not in (keys, keys - {"lam"}):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise KeyError(f"sepa state: expected keys ['gate_open', 'lam', 'step'], got {got}")
        step = d["step"]
        if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
            raise ValueError(f"sepa state step: expected an int >= 0, got {step!r}")
        if not isinstance(d["gate_open"], bool):
            raise ValueError(f"sepa state gate_open: expected a bool, got {d['gate_open']!r}")
        lam = d.get("lam")
        if lam is not None and not (_num(lam) and 0 <= lam <= 1):
            raise ValueError(f"sepa state lam: expected a number in [0, 1], got {lam!r}")
        self.step, self.gate_open = step, d["gate_open"]
        self.current = float(lam) if lam is not None else self.resolve(step)


def pooled_surprisal(surprisal: Tensor, mask: Tensor, planning: Tensor, lam: float) -> Tensor:
    """Execution tokens' surprisal pulled toward their response's mean by ``lam``; planning tokens
    (and responses without an execution token) unchanged."""
    ex = mask & ~planning
    n = ex.sum(1, keepdim=True)
    mu = masked_fill_zero(surprisal, ex).sum(1, keepdim=True) / n.clamp_min(1)
    pooled = lam * mu + (1.0 - lam) * surprisal
    return torch.where(ex & (n > 0), pooled, surprisal)


@register_calibrator(
    "sepa",
    config=SEPAConfig,
    requires=("logprobs", "planning_mask"),
    provenance="ref-code",
    summary="execution tokens' surprisal pooled toward their mean (annealed), then GTPO surprisal weights",
    paired_with="grpo",
    state_cls=SEPAController,
)
def sepa(batch: CreditBatch, advantages: Tensor, config: SEPAConfig, state: Optional[SEPAController] = None) -> CreditOutput:
    check_advantages(batch, advantages, "sepa")
    m = batch.mask
    adv = advantages.detach()
    dt = torch.promote_types(batch.logprobs.dtype, adv.dtype)
    s = torch.where(m, -batch.logprobs.detach().to(dt), torch.zeros((), dtype=dt)).clamp(max=MAX_SURPRISAL)
    plan = m & (batch.planning_mask == 1)
    lam = state.lam() if state is not None else (config.lam if config.lam is not None else 0.0)
    sp = pooled_surprisal(s, m, plan, lam) if lam > 0 else s
    n = m.sum(1, keepdim=True)
    mean = masked_fill_zero(sp, m).sum(1, keepdim=True) / n.clamp_min(1)
    w = (1.0 + config.beta * (sp / (mean + 1e-8) - 1.0)).clamp_min(0.0)
    w = torch.where(mean < 1e-7, torch.ones_like(w), w)
    w = masked_fill_zero(w, m)
    out = masked_fill_zero(w.to(adv.dtype) * torch.where(m, adv, torch.zeros_like(adv)), m)
    return CreditOutput(
        advantages=out,
        token_weights=w,
        metrics={
            "sepa/lambda": float(lam),
            "sepa/planning_frac": float(masked_mean(plan.to(dt), m)) if bool(m.any()) else 0.0,
            "sepa/weight_mean": float(masked_mean(w, m)) if bool(m.any()) else 1.0,
        },
    )

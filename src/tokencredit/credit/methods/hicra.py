"""HICRA (Hierarchy-Aware Credit Assignment): amplify the credit of planning tokens.

    A'_t = A_t + alpha |A_t| m_t          m_t = 1 on planning tokens, 0 on execution tokens

Planning tokens are found by strategic-gram matching on the decoded response
(:func:`planning_mask_of`): a window of up to ``max(5, longest gram in words)`` cleaned token
fragments, joined by spaces, is searched (case-insensitive, word boundaries) for any gram of
:data:`DEFAULT_STRATEGIC_GRAMS` ("wait let me", "let me check", "the key is", ...); from each
start position the first window that matches marks its tokens. A positive credit grows by a
factor (1 + alpha), a negative one shrinks in magnitude by it (A + alpha |A| = (1 - alpha) A for
A < 0): planning tokens of failures are penalised less.

Provenance: **ref-code**: the ``teilomillet/retrain`` project, which composes HICRA after its
GTPO weighting (``retrain/advantages/credit.py`` ``apply_hicra``; the detector
``retrain/advantages/planning.py`` and ``retrain/planning/regex.py``, the gram list and alpha = 0.2
from ``retrain/config/schema.py``). The HICRA paper (Wang et al. 2025, "Emergent hierarchical
reasoning in LLMs through RL") defines the same amplification on GRPO's advantages; here HICRA
is a calibrator after any estimator (``"hicra"`` = ``"grpo+hicra"``).

The planning mask is the ``planning_mask`` signal of the batch (:mod:`tokencredit.credit.planning`):
the trainers compute it from the step's decoded response tokens (``passes.run_passes``, own
trainer and TRL); ``tokencredit inspect`` and ``fidelity`` from a rollouts file's decoded tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero, masked_mean
from ..planning import DEFAULT_STRATEGIC_GRAMS, planning_mask_of
from ..registry import CreditOutput, register_calibrator

__all__ = ["HICRAConfig", "hicra", "planning_mask_of", "DEFAULT_STRATEGIC_GRAMS"]

@dataclass
class HICRAConfig:
    # retrain's hicra_alpha (config/schema.py): planning credit A + alpha |A|
    alpha: float = 0.2

    def __post_init__(self):
        a = self.alpha
        if not (isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) and a >= 0):
            raise ValueError(f"hicra alpha: expected a finite number >= 0, got {a!r}")


@register_calibrator(
    "hicra",
    config=HICRAConfig,
    requires=("planning_mask",),
    provenance="ref-code",
    summary="planning tokens (strategic-gram matches) get A + alpha |A|",
    paired_with="grpo",
)
def hicra(batch: CreditBatch, advantages: Tensor, config: HICRAConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "hicra")
    m = batch.mask
    adv = masked_fill_zero(advantages.detach(), m)
    plan = m & (batch.planning_mask == 1)
    w = 1.0 + config.alpha * torch.sign(adv) * plan.to(adv.dtype)  # A + alpha |A| = (1 + alpha sign A) A
    out = masked_fill_zero(adv + config.alpha * adv.abs() * plan.to(adv.dtype), m)
    return CreditOutput(
        advantages=out,
        token_weights=masked_fill_zero(w, m),
        metrics={"hicra/planning_frac": float(masked_mean(plan.to(adv.dtype), m)) if bool(m.any()) else 0.0},
    )

"""OAR-G (Outcome-grounded Advantage Reshaping, gradient variant; Li et al. 2026, arXiv 2601.07408):
each response's advantage redistributed over its reasoning tokens by how much each token moves
the policy's predicted outcome, the response's total kept.

With s_t >= 0 the outcome saliency of reasoning token t (``outcome_saliency``, the declared
saliency pass: |<dJ/de_t, e_t>|, J the KL between the clean and the embedding-noised outcome
distribution; :mod:`tokencredit.engine.saliency`) and R the response's reasoning tokens::

    u_t   = log(1 + s_t)
    n_t   = (u_t - min_R u) / (max_R u - min_R u)          (range 1 when all u are equal)
    tau   = quantile(n, q)                                  (linear interpolation, per response)
    w_t   = max(n_t / (tau + eps), floor)                   n_t <  tau   (suppress)
    w_t   = 1 + beta (n_t - tau) / (1 - tau + eps)          n_t >= tau   (boost)
    w_t  <- w_t |R| / (sum_R w + eps)                       sum_to_len (mass preserved)
    A'_t  = w_t A_t   on R,     A'_t = A_t   on the outcome tokens

Defaults: q = 0.8, beta = 1.0 (our choice, below), floor = 0.1, eps = 1e-8, sum_to_len = True;
the saliency pass: answer_tokens = 1, noise_std = 1e-3, kl_eps = 1e-12. With a sequence-level
advantage (GRPO's), sum_t A'_t = sum_t A_t up to the eps (sum_R w = |R| S / (S + eps), S the
weights' sum before the rescaling), and a zero advantage stays zero.

Provenance: **reconstructed**, from the authors' public code where it is defined and the paper
where it is not. ``Valsure/Outcome-Grounded-Advantage-Reshaping`` (``OAR-main.py``, one file)
defines the bi-level weights (``calculate_oar_hybrid_weights``: log1p, min-max, the quantile
threshold, the 0.1 floor, the 1e-8 epsilons, ``sum_to_L``), the gradient proxy
(``calculate_token_importance_gradient``: ``noise_std`` 1e-3, ``eps`` 1e-12, ``pfinal_mode``
``"answer_mean"``, saliency |grad . embedding|) and A'_t = A w_t (``compute_loss``). It calls
names it never defines (``create_test_case``, ``prepare_input_segments``,
``get_pfinal_representation``, ``PAD_TOKEN_ID``) and reads q, beta and ``sum_to_L`` from an
``args`` object with no parser or defaults. Reconstructed here:

* the outcome: the authors append a concluding template and the answer after the reasoning;
  here the response's own last ``answer_tokens`` tokens are its outcome, the tokens before them
  its reasoning (no template or reference answer is appended);
* q = 0.8 and beta = 1.0: the values the paper runs with could not be read; q = 0.8 boosts the
  top fifth of each response (the 80/20 split of the forking-token work), beta = 1.0 at most
  doubles a token's weight before the mass renormalisation. Both are config fields;
* ``sum_to_len`` on by default: the paper's reshaping "preserves the overall advantage mass";
* per-response q: the authors' loop overwrites its ``threshold`` variable with the first
  response's quantile *value*, which then serves as the next response's q; here each response
  takes its q-quantile (the paper's rule; the loop's carry-over reads as a bug).

OAR-P (the counterfactual variant: each reasoning token replaced by the pad token, one forward
per token) is not implemented: R extra forwards per response; OAR-G is one forward and one
backward (the paper's "negligible overhead" variant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import check_advantages, masked_fill_zero
from ..registry import CreditOutput, SaliencyPass, register_calibrator

__all__ = ["OARConfig", "oar", "bilevel_weights"]


def _number(name: str, v, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else f"{'>' if lo_open else '>='} {lo:g}"
        raise ValueError(f"oar {name}: expected a finite number {'in ' + rng if math.isfinite(hi) else rng}, got {v!r}")


@dataclass
class OARConfig:
    # q: the per-response quantile of the normalised importance that splits suppress / boost (our choice)
    quantile: float = 0.8
    # beta: boost strength above the threshold, w = 1 + beta (n - tau) / (1 - tau) (our choice)
    beta: float = 1.0
    # the suppressed tokens' lowest weight (the authors' 0.1)
    floor: float = 0.1
    # rescale each response's reasoning weights to sum to its reasoning length (the authors' sum_to_L)
    sum_to_len: bool = True
    # the authors' 1e-8 in the threshold and renormalisation denominators
    eps: float = 1e-8
    # the saliency pass: the response's last tokens taken as its outcome (reconstruction)
    answer_tokens: int = 1
    # the saliency pass: std of the Gaussian noise on the reasoning embeddings (the authors' noise_std)
    noise_std: float = 1e-3
    # the saliency pass: eps inside log p_0 of the KL (the authors' eps)
    kl_eps: float = 1e-12

    def __post_init__(self):
        _number("quantile", self.quantile, 0.0, 1.0)
        _number("beta", self.beta, 0.0, math.inf)
        _number("floor", self.floor, 0.0, 1.0)
        _number("eps", self.eps, 0.0, 1.0, lo_open=True)
        _number("noise_std", self.noise_std, 0.0, math.inf)
        _number("kl_eps", self.kl_eps, 0.0, 1.0)
        if not isinstance(self.sum_to_len, bool):
            raise ValueError(f"oar sum_to_len: expected a bool, got {self.sum_to_len!r}")
        a = self.answer_tokens
        if not (isinstance(a, int) and not isinstance(a, bool) and a >= 1):
            raise ValueError(f"oar answer_tokens: expected an int >= 1, got {a!r}")

    def saliency_pass(self) -> SaliencyPass:
        return SaliencyPass(answer_tokens=self.answer_tokens, noise_std=self.noise_std, kl_eps=self.kl_eps)


def bilevel_weights(score: Tensor, config: OARConfig) -> Tensor:
    """OAR's weights w [R] of one response's reasoning tokens from their importance ``score`` [R] (>= 0)."""
    u = torch.log1p(score.double())
    lo, hi = u.min(), u.max()
    n = (u - lo) / (hi - lo if bool(hi > lo) else 1.0)
    tau = torch.quantile(n, config.quantile)
    low = n < tau
    w = torch.where(
        low,
        torch.clamp_min(n / (tau + config.eps), config.floor),  # suppress
        1.0 + config.beta * (n - tau) / (1.0 - tau + config.eps),  # boost
    )
    if config.sum_to_len:
        total = w.sum()
        w = torch.ones_like(w) if bool(total <= 0) else w * (w.numel() / (total + config.eps))
    return w


@register_calibrator(
    "oar",
    config=OARConfig,
    requires=("outcome_saliency",),
    provenance="reconstructed",
    summary="OAR-G: advantage redistributed over reasoning tokens by input-gradient outcome saliency, mass kept",
    paired_with="grpo",
    saliency=OARConfig.saliency_pass,
)
def oar(batch: CreditBatch, advantages: Tensor, config: OARConfig, state=None) -> CreditOutput:
    check_advantages(batch, advantages, "oar")
    m = batch.mask
    adv = masked_fill_zero(advantages.detach(), m)
    reasoning, _ = config.saliency_pass().split(m)
    sal = batch.outcome_saliency.detach()
    w = torch.ones_like(adv)
    for b in range(adv.shape[0]):
        r = reasoning[b]
        if bool(r.any()):
            w[b, r] = bilevel_weights(sal[b, r], config).to(adv.dtype)
    boosted = reasoning & (w > 1)
    nr = int(reasoning.sum())
    return CreditOutput(
        advantages=masked_fill_zero(adv * w, m),
        token_weights=masked_fill_zero(w, m),
        metrics={
            "oar/boosted_frac": int(boosted.sum()) / nr if nr else 0.0,
            "oar/weight_max": float(w[reasoning].max()) if nr else 1.0,
            "oar/weight_min": float(w[reasoning].min()) if nr else 1.0,
        },
    )

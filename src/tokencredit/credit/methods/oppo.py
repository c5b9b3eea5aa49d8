"""OPPO (Oracle-Prompted Policy Optimization): the oracle log-ratio as a Bayesian belief update.

Evidence from one extra forward pass of an oracle O that sees the reference answer
(x+ = x plus the answer, :func:`oracle_prompt`), on the policy's own tokens, and the belief
recursion in log-odds form (``form="log_odds"``, the default):

    e_t     = clip(log pi_O(y_t | x+, y_<t) - log pi_theta(y_t | x, y_<t), -c, c)   detached
    V_0     = clip(prior success rate of the group, eps, 1 - eps),   l_0 = logit(V_0)
    l_t     = l_{t-1} + e_t,   V_t = sigmoid(l_t)                    over valid tokens (holes skipped)
    V_last  := R                                                     at the last valid token, R in [0, 1]
    A_t     = V_t - V_{t-1}                                          (accumulate and state_weight on)
    A_t     := |A_t| sign(R - mean_g R)                              direction anchoring (anchor="flip")

The credits telescope, ``sum_t A_t = R - V_0`` for every response with a valid token (before
anchoring). To first order A_t ~ V_{t-1}(1 - V_{t-1}) e_t: the discrimination signal e_t times a
state weight that is largest where success is most uncertain. When ``accumulate`` and
``state_weight`` are not both on, that first-order form, the linearisation of the recursion, is
the advantage:

    A_t = g_t * e_t,   g_t = V_0 (1 - V_0)   if state_weight (log-odds form; V_0 in the probability form)
                       g_t = 1               otherwise, so A_t = e_t

and with anchoring also off and ``evidence_clip`` equal to OPD's clip (``math.inf`` for OPD's
default of none) the advantage is exactly OPD's reward (``opd.py``); at OPPO's defaults (state
weight, anchor "flip", clip 5) it is not (tests/test_oppo.py names each departure).

``form="probability"`` is the earlier reconstruction, kept as a labelled option:
V_t = clip(V_{t-1} exp(e_t), eps, 1 - eps), whose linearisation is V_{t-1} e_t.

Direction anchoring (``anchor``) forces sign(A_t) = sign(A_b), A_b = R - mean_g R: "flip" uses
|A_t| sign(A_b), "zero" zeroes the tokens that disagree. Where A_b = 0 (the response is at its
group's mean, e.g. all rewards equal) there is no outcome direction to anchor to and every token
gets 0 credit, as under GRPO. Anchoring breaks the telescoping sum.

Provenance: the claims (Bayesian-update reading, running success probability, factorisation,
OPD as the self-oracle special case) are the paper's abstract; the log-odds recursion and its
first order are from a third-party digest of the paper's method section; direction anchoring
and evidence clipping are named in the paper's recipe. The clip values, the prior, the terminal
condition, the anchoring modes' exact form and the oracle template are a **reconstruction**
(docs/methods.md, section OPPO), not the authors' exact algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import CreditBatch, CreditInputError
from ..ops import sign_agreement
from ..ops import group_mean, groups_of, masked_fill_zero, masked_mean
from ..registry import CreditOutput, register_estimator
from .opd import DEFAULT_ORACLE_TEMPLATE, check_template, distillation_evidence, oracle_pass, oracle_prompt

__all__ = ["OPPOConfig", "oppo", "oracle_prompt", "belief_trajectory", "DEFAULT_ORACLE_TEMPLATE"]

# the concentration metric reports the |A| mass on the top 1/_TOP_DIVISOR of a trajectory's
# tokens (10 %), rounded up; integer arithmetic avoids ceil(30 * 0.1) = 4 in floating point
_TOP_DIVISOR = 10


@dataclass
class OPPOConfig:
    # belief recursion: "log_odds" l_t = l_{t-1} + e_t, V_t = sigmoid(l_t) (a digest of the paper's
    # method section; its first order is the abstract's "e_t times a state weight V(1 - V)") or
    # "probability" V_t = clip(V_{t-1} exp(e_t), eps, 1 - eps) (our earlier reconstruction)
    form: str = "log_odds"
    # "evidence clipping" is named in the paper's recipe; the value is reconstructed: one tail
    # token (either model gives it < e^-5 ~ 0.7 %) cannot alone move the log-odds by more than 5.
    # math.inf disables the clip.
    evidence_clip: float = 5.0
    # reconstructed: keeps V_0 off 0 and 1 so that l_0 = logit(V_0) is finite (probability form:
    # also every V_t, since 0 and 1 are absorbing for a multiplicative update)
    eps: float = 1e-3
    # reconstructed (research notes: "V_0 the prior (group success rate)"); "leave_one_out"
    # excludes the response's own outcome from its prior
    prior: str = "group_mean"
    # paper claim "accumulating it gives a running success probability"; off: V stays at V_0
    accumulate: bool = True
    # paper claim "a state weight concentrated on pivotal tokens"; off (with either flag off
    # the first-order form A_t = g_t e_t is used) gives A_t = e_t, the OPD reward
    state_weight: bool = True
    # direction anchoring: the paper's recipe ("GRPO plus direction anchoring and evidence
    # clipping") and its ablation's most important piece, so on by default; "flip" | "zero" |
    # "off". "flip" keeps every token's magnitude; "zero" drops the tokens that disagree (about
    # half of them on mul1). docs/methods.md, OPPO, "Defaults" has the measurement.
    anchor: str = "flip"
    # which model scores the oracle prompt: the policy itself ("self", self-oracle, recovers
    # SDPO/OPD) or a frozen stronger model ("teacher"; a trainer without one refuses the spec)
    oracle: str = "self"
    # reconstructed: x+ = x plus the reference answer; see opd.DEFAULT_ORACLE_TEMPLATE
    oracle_template: str = DEFAULT_ORACLE_TEMPLATE

    def __post_init__(self):
        if self.form not in ("log_odds", "probability"):
            raise ValueError(f"oppo form: expected 'log_odds' or 'probability', got {self.form!r}")
        c = self.evidence_clip
        if not (isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0):
            raise ValueError(f"oppo evidence_clip: expected a number > 0 (math.inf for no clip), got {c!r}")
        if not (isinstance(self.eps, (int, float)) and 0 < self.eps < 0.5):
            raise ValueError(f"oppo eps: expected a number in (0, 0.5), got {self.eps!r}")
        if self.prior not in ("group_mean", "leave_one_out"):
            raise ValueError(f"oppo prior: expected 'group_mean' or 'leave_one_out', got {self.prior!r}")
        for name in ("accumulate", "state_weight"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"oppo {name}: expected a bool, got {getattr(self, name)!r}")
        if self.anchor not in ("off", "zero", "flip"):
            # YAML (--credit-args, --config) reads a bare off as False
            hint = " (YAML reads a bare off as false: quote it, oppo.anchor='\"off\"')" if self.anchor is False else ""
            raise ValueError(f"oppo anchor: expected 'off', 'zero' or 'flip', got {self.anchor!r}{hint}")
        if self.oracle not in ("self", "teacher"):
            raise ValueError(f"oppo oracle: expected 'self' or 'teacher', got {self.oracle!r}")
        check_template(self.oracle_template, "oppo oracle_template")


def belief_trajectory(v0: Tensor, evidence: Tensor, mask: Tensor, eps: float, form: str = "log_odds"):
    """The belief recursion over valid tokens.

    Returns ``(before, after)``, both [B, T]: ``before[:, t] = V_{t-1}`` (the belief before
    token t, V_0 at the first valid token) and ``after[:, t] = V_t``. At a masked position
    the belief is carried unchanged, so holes and padding do not move it.

    ``form="log_odds"``: l_t = logit(V_0) + sum of e over the valid tokens up to t,
    V_t = sigmoid(l_t); ``v0`` must lie in (0, 1) and the evidence be finite.
    ``form="probability"``: V_t = clip(V_{t-1} exp(e_t), eps, 1 - eps).
    """
    if form == "log_odds":
        e = torch.where(mask, evidence, torch.zeros_like(evidence))
        l0 = torch.logit(v0).unsqueeze(1)
        after = torch.sigmoid(l0 + e.cumsum(1))
        # V_{t-1} is the previous column of V_t itself (V_0 before the first), so that
        # before[:, t] is after[:, t - 1] bitwise and the credits telescope exactly (a second
        # sigmoid over a shifted copy may round differently in vectorised and scalar lanes)
        before = torch.cat([torch.sigmoid(l0), after[:, :-1]], dim=1)
        return before, after
    v = v0
    before, after = [], []
    for t in range(mask.shape[1]):
        before.append(v)
        # exp may overflow to inf for an unclipped huge e; v >= eps > 0 so the product is inf,
        # never NaN, and the clamp brings it back to 1 - eps
        nxt = (v * torch.exp(evidence[:, t])).clamp(eps, 1.0 - eps)
        v = torch.where(mask[:, t], nxt, v)
        after.append(v)
    return torch.stack(before, 1), torch.stack(after, 1)


def _top_mass(adv: Tensor, mask: Tensor, divisor: int = _TOP_DIVISOR) -> float:
    """Mean over trajectories with credit of the share of sum|A| held by the top ceil(n / divisor) tokens."""
    a = masked_fill_zero(adv.abs(), mask)
    srt = a.sort(dim=1, descending=True).values
    cum = srt.cumsum(1)
    n = mask.sum(1)
    k = ((n + divisor - 1) // divisor).clamp_min(1)
    top = cum.gather(1, (k - 1).clamp_max(a.shape[1] - 1).unsqueeze(1)).squeeze(1)
    total = cum[:, -1]
    rows = (n > 0) & (total > 0)
    if not bool(rows.any()):
        return 0.0
    return (top[rows] / total[rows]).mean().item()


def _last_share(adv: Tensor, mask: Tensor, is_last: Tensor) -> float:
    """Mean over trajectories with credit of |A_last| / sum_t |A_t|."""
    a = masked_fill_zero(adv.abs(), mask)
    total = a.sum(1)
    rows = total > 0
    if not bool(rows.any()):
        return 0.0
    return ((a * is_last).sum(1)[rows] / total[rows]).mean().item()


@register_estimator(
    "oppo",
    config=OPPOConfig,
    requires=("oracle_logprobs", "logprobs"),
    oracle=lambda c: oracle_pass(c.oracle, c.oracle_template, teacher_sees_oracle_prompt=True),
    provenance="reconstructed",
    summary="oracle-prompted log-ratio accumulated as a Bayesian success belief; credit = belief increments",
    needs_groups=True,
)
def oppo(batch: CreditBatch, config: OPPOConfig) -> CreditOutput:
    g = groups_of(batch, "oppo", min_size=2)
    m = batch.mask
    dt = torch.promote_types(batch.rewards.dtype, batch.logprobs.dtype)
    r = batch.rewards.detach().to(dt)
    out = (r < 0) | (r > 1)
    if bool(out.any()):
        i = int(out.nonzero()[0])
        raise CreditInputError(
            f"rewards: method 'oppo' needs outcomes in [0, 1] (the terminal belief is the outcome, a "
            f"success probability), got {r[i].item()} at index {i}"
        )
    eps = float(config.eps)

    mean_g = group_mean(r, g)
    if config.prior == "group_mean":
        prior = mean_g
    else:
        k = g.counts.to(dt)[g.index]
        prior = (mean_g * k - r) / (k - 1)
    v0 = prior.clamp(eps, 1.0 - eps)

    e, raw = distillation_evidence(batch, config.evidence_clip)
    e = e.to(dt)
    before, after = belief_trajectory(v0, e, m, eps, config.form)

    T = m.shape[1]
    pos = torch.arange(T, device=m.device).unsqueeze(0)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(dim=1).values
    is_last = m & (pos == last.unsqueeze(1))
    nonempty = last >= 0

    if config.accumulate and config.state_weight:
        after_t = torch.where(is_last, r.unsqueeze(1).expand_as(after), after)
        adv = after_t - before
    elif config.state_weight:
        # without accumulation the belief stays at V_0; the linearisation of the recursion in use
        v = v0.unsqueeze(1)
        adv = (v * (1.0 - v) if config.form == "log_odds" else v) * e
    else:
        adv = e
    adv = masked_fill_zero(adv, m)

    seq_adv = r - mean_g
    # how often the oracle's own direction agrees with the outcome (before anchoring forces it)
    agree = sign_agreement(adv, m, seq_adv)
    if config.anchor != "off":
        s = torch.sign(seq_adv).unsqueeze(1)
        if config.anchor == "zero":
            adv = torch.where(torch.sign(adv) == s, adv, torch.zeros_like(adv))
        else:
            adv = adv.abs() * s
        adv = masked_fill_zero(adv, m)

    # diagnostics of the belief (always from the accumulated recursion, before V_last := R)
    final = after.gather(1, last.clamp_min(0).unsqueeze(1)).squeeze(1)
    sw = before * (1.0 - before) if config.form == "log_odds" else before
    at_bound = m & ((after <= eps) | (after >= 1.0 - eps))
    clip = config.evidence_clip
    clipped = m & (raw.abs() > clip)
    metrics = {
        "oppo/prior_mean": v0.mean().item(),
        "oppo/evidence_abs_mean": masked_mean(e.abs(), m).item(),
        "oppo/evidence_mean": masked_mean(e, m).item(),
        "oppo/clip_frac": masked_mean(clipped.to(dt), m).item(),
        "oppo/final_belief_mean": final[nonempty].mean().item() if bool(nonempty.any()) else 0.0,
        # does the oracle's accumulated evidence predict the outcome? (Brier score, lower = better)
        "oppo/final_belief_brier": ((final - r) ** 2)[nonempty].mean().item() if bool(nonempty.any()) else 0.0,
        "oppo/belief_bound_frac": masked_mean(at_bound.to(dt), m).item(),
        "oppo/state_weight_mean": masked_mean(sw, m).item(),
        "oppo/sign_agree_frac": agree,
        "oppo/credit_top10pct_mass": _top_mass(adv, m),
        # share of a trajectory's |credit| on its last token (the terminal V := R): near 1 when
        # the evidence does not explain the outcome and the whole outcome lands on that token
        "oppo/last_token_credit_share": _last_share(adv, m, is_last),
    }
    return CreditOutput(advantages=adv, metrics=metrics)

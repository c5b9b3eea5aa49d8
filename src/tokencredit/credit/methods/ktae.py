"""KTAE (Key-token Advantage Estimation, Sun et al. 2025): token statistics of a group's rollouts.

Within each prompt group, the responses are split by outcome (correct: R > threshold) and
every token id y that occurs in them is scored by how strongly its presence is associated with
success, from a 2 x 2 contingency table of *responses* (not occurrences):

    a = correct responses containing y     b = wrong responses containing y
    c = correct responses without y        d = wrong responses without y

    fisher(y) = exp(-2 p)  (p the two-sided Fisher exact p-value of the table; 0 when p = 1, see p_one_rule)
    ig(y)     = H(outcome) - H(outcome | y present)                       (bits)
    x(y)      = asin sqrt(a / (a + c)) - asin sqrt(b / (b + d))           (Cohen's h)
              + tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5)               (tf_term: BM25 frequencies)
    tf_o      = f (k1 + 1) / (f + k1 (1 - bb + bb N_o / avg N)),  f = occurrences of y / N_o
                (N_o the valid tokens of outcome o's responses, avg N = (N_c + N_w) / 2)
    key(y)    = (alpha fisher + beta_ig ig) x / (alpha + beta_ig)
    s(y)      = top * (2 sigmoid(key) - 1)                                in (-top, top)

and the token advantage is the group-normalised outcome plus the score of the token's id:

    A_{b,t} = (R_b - mean_g R) / (std_g R + eps) + s_g(y_{b,t})

A group without both outcomes gives every token s = 0 (plain GRPO there).

Provenance: **ref-code**, read in the authors' repository xiaolizh1/KTAE
(``verl/workers/actor/compute_key_tokens.py`` for the scores, ``verl/trainer/ppo/core_algos.py``
``compute_ktae_outcome_advantage_and_keytokens`` for the combination and its defaults: alpha,
beta_ig, gamma_tf and top all 1.0 there; the launch scripts also pass beta_ig = 2, which that
estimator does not read). The Fisher term is 0 where "p = 1": ``p_one_rule="float32"``
(default) as the reference, whose float32 p-value of an exact-p = 1 table often sums to just
below 1.0 and keeps a term of about exp(-2); ``"exact"`` in float64 with a relative tie tolerance
of 1e-7 (as R's and SciPy's ``fisher_exact``), 0 exactly when p = 1 (the difference is measured in
docs/methods.md). Other deviations, numerical or tokenizer-specific: float64 elsewhere; the
reference zeroes the score of Qwen's ``<|endoftext|>`` (id 151643), here the ids in
``ignore_token_ids`` (default none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch
from torch import Tensor

from ..batch import CreditBatch
from ..ops import group_mean, group_std, groups_of, masked_fill_zero
from ..registry import CreditOutput, register_estimator

__all__ = ["KTAEConfig", "ktae", "key_token_scores", "fisher_exact_two_sided", "fisher_p_float32", "P_ONE_RULES"]

#: relative tolerance of the Fisher tie test (R's fisher.test, scipy.stats.fisher_exact)
FISHER_REL_TOL = 1e-7
#: KTAEConfig.p_one_rule: the reference's float32 test of p against 1.0, or the exact rule
P_ONE_RULES = ("float32", "exact")


@dataclass
class KTAEConfig:
    # the reference estimator's hard-coded weights (core_algos.py): the Fisher term ...
    alpha: float = 1.0
    # ... and the information-gain term, averaged with weights alpha and beta_ig
    beta_ig: float = 1.0
    # the reference's gamma_tf, used there only as a switch: add the BM25 term-frequency ratio to Cohen's h
    tf_term: bool = True
    # BM25 saturation constant of the reference's compute_tf (k1 = 2.0 there)
    k1: float = 2.0
    # BM25 length normalisation of the reference's compute_tf (b = 0.5 there): 0 ignores the
    # outcome's token count, 1 scales the saturation by it fully
    b: float = 0.5
    # the score's range (-top, top)
    top: float = 1.0
    # a response is "correct" when its reward exceeds this (the reference: R > 0)
    success_threshold: float = 0.0
    # the GRPO part: (R - mean) / (std + eps), unbiased std, as the reference
    eps: float = 1e-6
    # token ids whose score is forced to 0 (the reference zeroes Qwen's <|endoftext|>, 151643)
    ignore_token_ids: Tuple[int, ...] = ()
    # when the Fisher term is 0: "float32" as the reference (the p-value summed in float32, ties
    # compared exactly, the term kept wherever that sum != 1.0, often on tables whose exact p is 1),
    # or "exact" (float64, ties within a relative 1e-7, the term 0 exactly when p = 1)
    p_one_rule: str = "float32"

    def __post_init__(self):
        for name in ("alpha", "beta_ig"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise ValueError(f"ktae {name}: expected a finite number >= 0, got {v!r}")
        if not self.alpha + self.beta_ig > 0:
            raise ValueError(f"ktae alpha + beta_ig: expected > 0 (the score averages them), got {self.alpha + self.beta_ig}")
        if not isinstance(self.tf_term, bool):
            raise ValueError(f"ktae tf_term: expected a bool, got {self.tf_term!r}")
        if not (isinstance(self.k1, (int, float)) and self.k1 > 0):
            raise ValueError(f"ktae k1: expected a number > 0, got {self.k1!r}")
        if not (isinstance(self.b, (int, float)) and 0 <= self.b <= 1):
            raise ValueError(f"ktae b: expected a number in [0, 1], got {self.b!r}")
        if not (isinstance(self.top, (int, float)) and math.isfinite(self.top) and self.top > 0):
            raise ValueError(f"ktae top: expected a finite number > 0, got {self.top!r}")
        if not (isinstance(self.success_threshold, (int, float)) and math.isfinite(self.success_threshold)):
            raise ValueError(f"ktae success_threshold: expected a finite number, got {self.success_threshold!r}")
        if not self.eps > 0:
            raise ValueError(f"ktae eps: expected > 0, got {self.eps!r}")
        ids = self.ignore_token_ids
        if not (isinstance(ids, (tuple, list)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise ValueError(f"ktae ignore_token_ids: expected a list of token ids >= 0, got {ids!r}")
        self.ignore_token_ids = tuple(ids)
        if self.p_one_rule not in P_ONE_RULES:
            raise ValueError(f"ktae p_one_rule: expected one of {list(P_ONE_RULES)}, got {self.p_one_rule!r}")


def _log_comb(n: Tensor, k: Tensor) -> Tensor:
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def fisher_exact_two_sided(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """Two-sided Fisher exact tests of the tables [[a, b], [c, d]] (float64 tensors of one shape):
    ``(p, p_is_one)``, the probability under the hypergeometric law of the table's margins of the
    tables no more likely than the observed one (ties within a relative 1e-7 counted), and
    whether every table of the support was counted (p = 1 exactly)."""
    r1, c1 = a + b, a + c
    n = a + b + c + d
    lo = (r1 + c1 - n).clamp_min(0)
    hi = torch.minimum(r1, c1)
    K = int(hi.max().item()) + 1 if hi.numel() else 1
    k = torch.arange(K, dtype=a.dtype, device=a.device).expand(*a.shape, K)
    ok = (k >= lo.unsqueeze(-1)) & (k <= hi.unsqueeze(-1))
    kk = torch.where(ok, k, lo.unsqueeze(-1))  # keep lgamma's arguments valid off the support
    logp = _log_comb(c1.unsqueeze(-1), kk) + _log_comb((n - c1).unsqueeze(-1), r1.unsqueeze(-1) - kk) - _log_comb(
        n.unsqueeze(-1), r1.unsqueeze(-1))
    p = torch.where(ok, logp.exp(), torch.zeros_like(logp))
    pobs = (_log_comb(c1, a) + _log_comb(n - c1, r1 - a) - _log_comb(n, r1)).exp()
    keep = ok & (p <= pobs.unsqueeze(-1) * (1 + FISHER_REL_TOL))
    return torch.where(keep, p, torch.zeros_like(p)).sum(-1).clamp_max(1.0), keep.sum(-1) == ok.sum(-1)


def fisher_p_float32(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> Tensor:
    """The two-sided Fisher p-values of the tables [[a, b], [c, d]] as the reference computes
    them: float32 throughout, the tables no more likely than the observed one chosen by an exact
    comparison ``p_k <= p_obs``, summed over one grid of width ``max min(a + b, a + c) + 1``."""
    a, b, c, d = (x.to(torch.float32) for x in (a, b, c, d))
    r1, c1 = a + b, a + c
    n = r1 + c + d
    lo = (r1 + c1 - n).clamp_min(0)
    hi = torch.minimum(r1, c1)
    K = int(hi.max().item()) + 1 if hi.numel() else 1
    k = torch.arange(K, dtype=torch.float32, device=a.device).expand(*a.shape, K)
    ok = (k >= lo.unsqueeze(-1)) & (k <= hi.unsqueeze(-1))
    kk = torch.where(ok, k, lo.unsqueeze(-1))  # lgamma's arguments valid off the support
    c1_, r1_, n_ = c1.unsqueeze(-1), r1.unsqueeze(-1), n.unsqueeze(-1)
    p_k = (_log_comb(c1_, kk) + _log_comb(n_ - c1_, r1_ - kk) - _log_comb(n_, r1_)).exp() * ok.float()
    p_obs = (_log_comb(c1, a) + _log_comb(n - c1, r1 - a) - _log_comb(n, r1)).exp()
    return torch.where((p_k <= p_obs.unsqueeze(-1)) & ok, p_k, torch.zeros_like(p_k)).sum(-1)


def _entropy_bits(p: Tensor) -> Tensor:
    return torch.where(p > 0, -p * torch.log2(p.clamp_min(1e-300)), torch.zeros_like(p))


def key_token_scores(ids: Tensor, mask: Tensor, correct: Tensor, config: KTAEConfig) -> Tuple[Tensor, Tensor]:
    """One group's token scores: ``(vocab, s)``, the distinct token ids on valid positions and
    their score s(y) (float64). ``ids`` [n, T] integer, ``mask`` [n, T] bool, ``correct`` [n] bool."""
    valid = ids[mask]
    vocab, inv = torch.unique(valid, return_inverse=True)
    U = vocab.numel()
    f64 = torch.float64
    if U == 0 or bool(correct.all()) or not bool(correct.any()):
        return vocab, torch.zeros(U, dtype=f64, device=ids.device)
    n = ids.shape[0]
    rows = torch.arange(n, device=ids.device).unsqueeze(1).expand_as(ids)[mask]
    occ = torch.zeros(n, U, dtype=f64, device=ids.device).index_put_((rows, inv), torch.ones_like(inv, dtype=f64), accumulate=True)
    present = (occ > 0).to(f64)
    cf, wf = correct.to(f64), (~correct).to(f64)
    a, b = cf @ present, wf @ present
    Nc, Nw = cf.sum(), wf.sum()
    c, d = Nc - a, Nw - b
    tot = a + b + c + d
    # information gain of "y present" about the outcome, in bits
    h_y = _entropy_bits(Nc / tot) + _entropy_bits(Nw / tot)

    def cond(x1, x2):
        s = x1 + x2
        return torch.where(s > 0, _entropy_bits(x1 / s.clamp_min(1)) + _entropy_bits(x2 / s.clamp_min(1)), torch.zeros_like(s))

    ig = h_y - ((a + b) / tot * cond(a, b) + (c + d) / tot * cond(c, d))
    if config.alpha and config.p_one_rule == "float32":
        p32 = fisher_p_float32(a, b, c, d)
        fisher = torch.where(p32 != 1.0, torch.exp(-2 * p32), torch.zeros_like(p32)).to(f64)  # the reference's rule
    elif config.alpha:
        p, all_kept = fisher_exact_two_sided(a, b, c, d)
        fisher = torch.where(all_kept, torch.zeros_like(p), torch.exp(-2 * p))  # p = 1: no evidence
    else:
        fisher = torch.zeros(U, dtype=f64, device=ids.device)
    x = torch.asin(torch.sqrt((a / (a + c + 1e-10)).clamp(0, 1))) - torch.asin(torch.sqrt((b / (b + d + 1e-10)).clamp(0, 1)))
    if config.tf_term:
        Tc = (occ * cf.unsqueeze(1)).sum(0)  # occurrences of y in correct responses
        Tw = (occ * wf.unsqueeze(1)).sum(0)
        Lc = (mask.to(f64).sum(1) * cf).sum()
        Lw = (mask.to(f64).sum(1) * wf).sum()
        avg = (Lc + Lw) / 2
        k1, bb = float(config.k1), float(config.b)
        fc, fw = Tc / Lc.clamp_min(1), Tw / Lw.clamp_min(1)
        tf_c = fc * (k1 + 1) / (fc + k1 * (1 - bb + bb * Lc / avg))
        tf_w = fw * (k1 + 1) / (fw + k1 * (1 - bb + bb * Lw / avg))
        x = x + tf_c / (tf_w + 1e-5) - tf_w / (tf_c + 1e-5)
    key = (config.alpha * fisher + config.beta_ig * ig) * x / (config.alpha + config.beta_ig)
    s = (torch.sigmoid(key) - 0.5) * 2 * config.top
    if config.ignore_token_ids:
        s = torch.where(torch.isin(vocab, torch.tensor(config.ignore_token_ids, device=vocab.device)), torch.zeros_like(s), s)
    return vocab, s


@register_estimator(
    "ktae",
    config=KTAEConfig,
    requires=("token_ids",),
    provenance="ref-code",
    summary="GRPO plus a per-token-id score from the group's rollout statistics (Fisher, information gain, Cohen's h, BM25)",
    needs_groups=True,
)
def ktae(batch: CreditBatch, config: KTAEConfig) -> CreditOutput:
    g = groups_of(batch, "ktae")
    m = batch.mask
    r = batch.rewards.detach()
    seq = (r - group_mean(r, g)) / (group_std(r, g, unbiased=True) + config.eps)
    ids = batch.token_ids.detach()
    ids = torch.where(m, ids, torch.zeros_like(ids)).round().long() if ids.is_floating_point() else torch.where(m, ids, torch.zeros_like(ids)).long()
    score = torch.zeros(m.shape, dtype=torch.float64, device=m.device)
    correct_all = r > config.success_threshold
    keyed = 0
    for gi in range(g.n):
        rows = (g.index == gi).nonzero().squeeze(1)
        vocab, s = key_token_scores(ids[rows], m[rows], correct_all[rows], config)
        if vocab.numel():
            pos = torch.searchsorted(vocab, ids[rows].clamp_max(int(vocab[-1]))).clamp_max(vocab.numel() - 1)
            score[rows] = torch.where(m[rows], s[pos], torch.zeros_like(s[pos]))
            keyed += int((s != 0).sum())
    adv = masked_fill_zero(seq.unsqueeze(1).to(torch.float64) + score, m).to(torch.promote_types(r.dtype, torch.float32))
    sc = score[m]
    return CreditOutput(
        advantages=adv,
        metrics={
            "ktae/score_abs_mean": sc.abs().mean().item() if sc.numel() else 0.0,
            "ktae/score_pos_frac": (sc > 0).double().mean().item() if sc.numel() else 0.0,
            "ktae/scored_token_ids": float(keyed),
        },
    )

"""The scores: every method's credit, replayed on an estimates file's batch as ``tokencredit
inspect`` replays (:func:`tokencredit.train.records.replay`; a method with a critic on the critic
stored in the file, if any), against the true credit, per trajectory and then averaged, with a
bootstrap interval that resamples prompt groups (:func:`score`, :func:`format_table`).

:func:`trajectory_metrics` defines the four metrics (pivotal mass, sign agreement, rank
correlation, contamination). The split-half rows (the estimate from half the continuations
against the other half, on all trajectories and on the groups with mixed outcomes) show what
Monte Carlo noise alone does; :func:`spearman_brown` turns them into the rank correlation that
perfect credit would reach against the full estimate (the noise ceiling).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .base import FidelityError, response_lengths
from .estimates import complete_rows, credit_spans, span_sums, span_values, standard_errors

__all__ = ["METRICS", "FidelityConfig", "bootstrap_mean", "critic_method", "format_interval", "format_table", "is_constant",
           "mixed_groups", "row_scores", "score", "scored_rows", "spearman", "spearman_brown", "top_weights", "trajectory_metrics",
           "with_own_critics"]


@dataclass
class FidelityConfig:
    """Settings of the scores (not of the estimates)."""

    # pivotal mass: share of |A| on the top 10% positions (tokens, or spans with stride > 1;
    # at least one) by |c| (issue 10)
    top_frac: float = 0.1
    # contamination: positive credit on positions whose true credit is below -delta. With M = 16
    # the standard error of one c is about 0.1 on the reference set (up to 0.18 at V = 0.5):
    # delta = 0.1 counts positions about one standard error below 0, not certain harm
    delta: float = 0.1
    n_boot: int = 1000  # bootstrap resamples of the prompt groups
    level: float = 0.95  # two-sided bootstrap interval
    seed: int = 0  # bootstrap and the random-credit row

    def __post_init__(self):
        if not 0 < self.top_frac <= 1:
            raise FidelityError(f"top_frac: expected in (0, 1], got {self.top_frac}")
        if not self.delta >= 0:
            raise FidelityError(f"delta: expected >= 0, got {self.delta}")
        if int(self.n_boot) != self.n_boot or self.n_boot < 1:
            raise FidelityError(f"n_boot: expected an integer >= 1, got {self.n_boot}")
        if not 0 < self.level < 1:
            raise FidelityError(f"level: expected in (0, 1), got {self.level}")


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n with ties given their average rank."""
    n = x.numel()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty(n, dtype=torch.float64)
    xs = x[order]
    i = 0
    while i < n:
        j = i
        while j + 1 < n and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i: j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: torch.Tensor, c: torch.Tensor) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    if a.numel() < 3:
        return float("nan")
    ra, rc = _ranks(a.double()), _ranks(c.double())
    ra, rc = ra - ra.mean(), rc - rc.mean()
    den = math.sqrt(float((ra * ra).sum()) * float((rc * rc).sum()))
    return float((ra * rc).sum()) / den if den > 0 else float("nan")


METRICS = ("pivotal_mass", "sign_agreement", "rank_corr", "contamination")


def top_weights(x: torch.Tensor, k: int) -> torch.Tensor:
    """Membership of each position in the top ``k`` by ``x``, ties at the cut shared: positions
    above the k-th largest value get 1, those equal to it share the remaining places equally
    (so the weights sum to ``k`` and no tie is broken by position)."""
    x = torch.as_tensor(x).double()
    k = min(int(k), x.numel())
    if k <= 0:
        return torch.zeros_like(x)
    v = torch.sort(x, descending=True).values[k - 1]
    above, at = x > v, x == v
    return above.double() + at.double() * (k - int(above.sum())) / int(at.sum())


def trajectory_metrics(a: torch.Tensor, c: torch.Tensor, success: bool, cfg: FidelityConfig = FidelityConfig()) -> Dict[str, float]:
    """The four metrics of one trajectory's credit ``a`` against true credit ``c`` (per token
    or per span; NaN where undefined):

    - ``pivotal_mass``: the share of ``sum |a|`` on the top ``ceil(top_frac * n)`` positions by
      ``|c|``, ties at the cut shared (:func:`top_weights`); undefined when ``c`` is 0 everywhere
      (nothing is pivotal) or ``a`` is (uniform credit: about ``top_frac``);
    - ``sign_agreement``: ``sum |c| * [sign a == sign c] / sum |c|``, a zero ``a`` counting half;
      undefined when ``a`` or ``c`` is 0 everywhere (a method that gives no credit is not scored);
    - ``rank_corr``: Spearman correlation of ``a`` with ``c`` (undefined when either is constant);
    - ``contamination`` (successful responses only; TACO's failure mode): the share of positive
      credit ``sum a+`` given to positions with ``c < -delta``.
    """
    a, c = torch.as_tensor(a).double(), torch.as_tensor(c).double()
    n = a.numel()
    out = {k: float("nan") for k in METRICS}
    if n == 0:
        return out
    w = c.abs()
    sa = float(a.abs().sum())
    if sa > 0 and float(w.sum()) > 0:
        k = max(1, math.ceil(cfg.top_frac * n - 1e-9))
        out["pivotal_mass"] = float((a.abs() * top_weights(w, k)).sum()) / sa
        out["sign_agreement"] = float((w * (torch.sign(a) * torch.sign(c) + 1) / 2).sum() / w.sum())
    out["rank_corr"] = spearman(a, c)
    if success:
        pos = a.clamp_min(0)
        if float(pos.sum()) > 0:
            out["contamination"] = float((pos * (c < -cfg.delta)).sum() / pos.sum())
    return out


def bootstrap_mean(values: Sequence[float], cfg: FidelityConfig = FidelityConfig(),
                   clusters: Optional[Sequence[int]] = None) -> Dict[str, float]:
    """Mean over trajectories (NaN skipped) with a percentile bootstrap interval. With
    ``clusters`` (the prompt group of each value) whole groups are resampled: the responses to
    one prompt are not independent, and resampling them one by one would narrow the interval."""
    keep = [i for i, x in enumerate(values) if not math.isnan(x)]
    v = torch.tensor([values[i] for i in keep], dtype=torch.float64)
    if v.numel() == 0:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0, "groups": 0}
    cl = torch.tensor([int(clusters[i]) for i in keep]) if clusters is not None else torch.arange(v.numel())
    _, cid = torch.unique(cl, return_inverse=True)
    G = int(cid.max()) + 1
    sums = torch.zeros(G, dtype=torch.float64).index_add_(0, cid, v)
    counts = torch.zeros(G, dtype=torch.float64).index_add_(0, cid, torch.ones_like(v))
    g = torch.Generator().manual_seed(cfg.seed)
    idx = torch.randint(0, G, (cfg.n_boot, G), generator=g)
    means = sums[idx].sum(1) / counts[idx].sum(1)
    q = torch.tensor([(1 - cfg.level) / 2, 1 - (1 - cfg.level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(means, q).tolist()
    return {"mean": float(v.mean()), "lo": lo, "hi": hi, "n": int(v.numel()), "groups": G}


def is_constant(adv_row: torch.Tensor, length: int) -> bool:
    """Whether a method's token credit is the same on every token of the response (uniform
    credit: GRPO, RLOO, ...). Its span sums still differ when the last span is shorter than the
    stride, which would give uniform credit a rank correlation with c that is only span length;
    :func:`score` reports it as undefined instead."""
    a = torch.as_tensor(adv_row).double()[:length]
    return bool(a.numel() == 0 or float(a.max() - a.min()) <= 1e-9 * max(1.0, float(a.abs().max())))


def row_scores(pairs: Sequence[Tuple], cfg: FidelityConfig, clusters: Optional[Sequence[int]] = None) -> Dict[str, Dict[str, float]]:
    """``pairs``: (a, c, success) or (a, c, success, constant); a constant credit has no rank.
    ``clusters``: the prompt group of each pair (the bootstrap resamples groups)."""
    per = []
    for p in pairs:
        m = trajectory_metrics(p[0], p[1], p[2], cfg)
        if len(p) > 3 and p[3]:
            m["rank_corr"] = float("nan")
        per.append(m)
    return {k: bootstrap_mean([p[k] for p in per], cfg, clusters) for k in METRICS}


def scored_rows(est: Dict[str, Any]) -> Tuple[List[int], int, List[int], List[bool]]:
    """Response lengths, the stride, the complete non-empty rows (what is scored) and, per row,
    whether it succeeded (reward 1)."""
    lengths = response_lengths(est["rollouts"])
    done = complete_rows(est)
    rows = [b for b in range(len(lengths)) if done[b] and lengths[b] > 0]
    if not rows:
        raise FidelityError("ESTIMATES: no complete trajectory to score")
    R = torch.as_tensor(est["rollouts"]["signals"]["rewards"]).double()
    return lengths, int(est["settings"]["stride"]), rows, [bool(r >= 1.0 - 1e-6) for r in R.tolist()]


def mixed_groups(saved: Dict[str, Any], rows: Sequence[int]) -> List[int]:
    """The rows whose prompt group has both outcomes (where group-relative credit is not 0)."""
    R = torch.as_tensor(saved["signals"]["rewards"]).double()
    g = torch.as_tensor(saved["signals"]["group_ids"])
    return [b for b in rows if bool((R[g == g[b]] != R[b]).any())]


def spearman_brown(r_half: float) -> float:
    """The expected correlation of perfect credit with the M-continuation estimate, from the
    correlation ``r_half`` of two independent M/2 estimates (split-half): the M estimate's
    reliability is ``2 r / (1 + r)`` (Spearman-Brown) and a perfect method correlates with it as
    the square root of that. NaN for r <= 0."""
    if not r_half > 0:
        return float("nan")
    return math.sqrt(2 * r_half / (1 + r_half))


def score(est: Dict[str, Any], specs: Optional[Sequence[str]] = None, *, credit_args: Sequence[str] = (),
          cfg: FidelityConfig = FidelityConfig()) -> Dict[str, Any]:
    """Score every replayed method (``specs`` default: what ``inspect`` replays) against the
    true credit of the complete trajectories of ``est``. Returns a JSON-able dict: ``rows``
    (one per method, plus ``true credit`` against itself, ``split-half`` on all trajectories and
    on the groups with mixed outcomes (the noise references), and ``random``), ``skipped``, the
    expected rank correlation of perfect credit (``perfect_rank_corr``) and the set's description.
    Intervals resample prompt groups."""
    from ...train.records import replay

    saved = est["rollouts"]
    lengths, stride, rows_idx, success = scored_rows(est)
    groups = torch.as_tensor(saved["signals"]["group_ids"]).tolist()
    mixed = mixed_groups(saved, rows_idx)
    V = span_values(est)
    c = {b: credit_spans(V[b]) for b in rows_idx}
    Ve, Vo = span_values(est, "even"), span_values(est, "odd")
    insp = replay(saved, specs, credit_args=credit_args)
    critic_note = None
    if saved["signals"].get("values") is not None:
        critic_note = f"critic of the {saved.get('credit', '?')} run (step {saved.get('step', '?')}), saved with its rollouts"
    views = with_own_critics(est, insp.views, credit_args)
    out_rows = []

    def add(label, kind, pairs, rows, note=None):
        out_rows.append({"method": label, "kind": kind, "note": note, **row_scores(pairs, cfg, [groups[b] for b in rows])})

    half = est["samples"].shape[-1] // 2
    add("true credit (MC)", "reference", [(c[b], c[b], success[b]) for b in rows_idx], rows_idx, "c against itself")
    for label, rows in (("split-half", rows_idx), ("split-half, mixed groups", mixed)):
        add(label, "reference", [(credit_spans(Ve[b]), credit_spans(Vo[b]), success[b]) for b in rows], rows,
            f"M/2 = {half} vs the other M/2" + (": the groups where group-relative credit is not 0" if rows is mixed else ""))
    g = torch.Generator().manual_seed(cfg.seed)
    add("random", "reference", [(span_sums(torch.randn(lengths[b], generator=g, dtype=torch.float64), lengths[b], stride), c[b], success[b])
                                for b in rows_idx], rows_idx, "i.i.d. normal credit")
    for v, note in views:
        add(v.label, v.source, [(span_sums(v.advantages[b], lengths[b], stride), c[b], success[b],
                                 is_constant(v.advantages[b], lengths[b])) for b in rows_idx], rows_idx,
            note if note is not None else (critic_note if critic_method(v.spec) else None))
    se = torch.cat([s for b, s in enumerate(standard_errors(est)) if b in set(rows_idx)])
    cs = torch.cat([c[b] for b in rows_idx])
    ref = {r["method"]: r for r in out_rows}
    return {
        "policy": est.get("policy", ""),
        "settings": est["settings"],
        "trajectories": len(rows_idx),
        "batch_size": len(lengths),
        "groups": len({groups[b] for b in rows_idx}),
        "mixed_trajectories": len(mixed),
        "successful": int(sum(success[b] for b in rows_idx)),
        "positions": int(cs.numel()),
        "mean_len": float(sum(lengths[b] for b in rows_idx) / len(rows_idx)),
        "v_se_mean": float(se.mean()),
        "c_abs_mean": float(cs.abs().mean()),
        "c_neg_frac": float((cs < -cfg.delta).double().mean()),
        "perfect_rank_corr": {k: spearman_brown(ref[f"split-half{s}"]["rank_corr"]["mean"])
                              for k, s in (("all", ""), ("mixed", ", mixed groups"))},
        "config": asdict(cfg),
        "build": {k: v for k, v in (est.get("build") or {}).items()},
        "rows": out_rows,
        "skipped": [{"spec": s.spec, "missing": s.missing, "error": s.error} for s in insp.skipped],
    }


def critic_method(spec: str) -> Optional[str]:
    """The method of ``spec`` that declares a critic (its estimator: gae, pact), or None."""
    from ...credit.spec import parse_spec

    try:
        methods = parse_spec(spec)
    except (KeyError, ValueError):  # a saved run's own label that is not a spec ("run")
        return None
    return next((m.name for m in methods if m.critic is not None), None)


def with_own_critics(est: Dict[str, Any], views, credit_args: Sequence[str]):
    """``(view, note)`` per replayed view: a spec whose critic method has a critic of its own in
    ``est["critics"]`` (:func:`attach_critic`) is replayed again on those values; the others keep
    the batch's own (note None)."""
    from ...train.records import replay

    critics = est.get("critics") or {}
    out = []
    for v in views:
        m = critic_method(v.spec) if v.source == "replayed" else None
        if m in critics:
            saved = dict(est["rollouts"], signals=dict(est["rollouts"]["signals"], values=critics[m]["values"]))
            again = replay(saved, [v.spec], credit_args=credit_args, include_saved=False).views
            if again:
                out.append((again[0], critics[m]["source"]))
                continue
        out.append((v, None))
    return out


def format_interval(m: Dict[str, float]) -> str:
    """A score with its interval as the tables print it: ``"mean [lo, hi]"``, "–" with no rows."""
    if not m["n"]:
        return "–"
    return f"{m['mean']:.3f} [{m['lo']:.2f}, {m['hi']:.2f}]"


def format_table(res: Dict[str, Any]) -> str:
    s = res["settings"]
    unit = "tokens" if s["stride"] == 1 else f"spans of {s['stride']} tokens"
    lines = [
        f"credit fidelity: {res['trajectories']} trajectories"
        + (f" (the complete ones of a batch of {res['batch_size']})" if res.get("batch_size", res["trajectories"]) > res["trajectories"] else "")
        + f" in {res.get('groups', '?')} prompt groups ({res['successful']} successful), {res['positions']} {unit}, "
        f"M = {s['M']} continuations per position, T = {s['temperature']}; mean SE of V = {res['v_se_mean']:.3f}; "
        f"policy: {res['policy'] or '?'}",
        f"metrics per trajectory, averaged, [{int(res['config']['level'] * 100)}% bootstrap over prompt groups]; "
        f"n: trajectories where the method gives credit (A != 0) and c != 0; contamination: positive credit on "
        f"c < -{res['config']['delta']} in successful responses",
        "",
    ]
    head = ("method", "n", "pivotal mass", "sign agreement", "rank corr", "contamination")
    width = max(len(head[0]), *(len(r["method"]) for r in res["rows"])) + 2
    lines.append(head[0].ljust(width) + head[1].rjust(3) + "  " + "".join(h.ljust(22) for h in head[2:]))
    for r in res["rows"]:
        lines.append(r["method"].ljust(width) + str(r["sign_agreement"]["n"]).rjust(3) + "  "
                     + "".join(format_interval(r[k]).ljust(22) for k in METRICS) + (f"  ({r['note']})" if r.get("note") else ""))
    for sk in res["skipped"]:
        why = ("missing " + ", ".join(sk["missing"])) if sk["missing"] else sk["error"]
        lines.append(f"not scored: {sk['spec']} ({why})")
    pr = res.get("perfect_rank_corr") or {}
    if pr:
        lines.append(
            f"rank correlation that perfect credit would reach against this estimate (Spearman-Brown from split-half): "
            f"{pr['all']:.2f} on all trajectories, {pr['mixed']:.2f} on the mixed groups")
    return "\n".join(lines)

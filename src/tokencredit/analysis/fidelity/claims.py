"""The numbers behind docs/fidelity.md's answers to the papers' token-level claims
(:func:`claims`, :func:`format_claims`): how sparse the true credit is (PACT), TACO's tail
tokens, and where each method puts its credit against where the true credit is.

The only module of the fidelity package that names methods: it reports named papers' claims
(:data:`CLAIM_SPECS`, TACO's tail risk) and chooses the methods the figure shows
(:data:`FIGURE_SPECS`). Everything else replays whatever the registry holds.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Sequence

import torch

from .base import mc_positions, response_lengths
from .estimates import credit_spans, span_sums, span_values, standard_errors
from .metrics import (
    FidelityConfig,
    bootstrap_mean,
    format_interval,
    scored_rows,
    top_weights,
    with_own_critics,
)

__all__ = ["CLAIM_SPECS", "FIGURE_SPECS", "claims", "format_claims"]

#: the methods whose |A| placement :func:`claims` reports (when the batch can replay them)
CLAIM_SPECS = ("grpo", "oppo", "grpo+taco", "grpo+stare", "grpo+acpo", "grpo+arca", "pact",
               "grpo+entropy", "grpo+surprisal", "grpo+divergence")
#: the methods whose A_t the figure (``tokencredit fidelity --figure``) draws against c_t
FIGURE_SPECS = ("grpo", "taco", "oppo", "stare", "acpo", "arca")


def paired_c_se(est: Dict[str, Any], rows: Sequence[int]) -> torch.Tensor:
    """The standard error of each scored span's ``c_p = V(h_next) - V(h_p)`` from the
    continuation-wise differences ``d_m = x_m(h_next) - x_m(h_p)`` (the reward ``R`` after the last
    span), ``sd_m(d) / sqrt(M)``, over ``rows``, concatenated. With common random numbers the two
    estimates are coupled and this is the SE that applies (``sqrt(2)`` x the SE of V assumes them
    independent); with independent continuations both estimate the same quantity. Unlike
    :func:`standard_errors` it is not smoothed: a span where every continuation pair agrees
    contributes 0."""
    lengths, stride = response_lengths(est["rollouts"]), int(est["settings"]["stride"])
    s = est["samples"].double()
    R = torch.as_tensor(est["rollouts"]["signals"]["rewards"]).double()
    M = s.shape[-1]
    out = []
    for b in rows:
        x = s[b, mc_positions(lengths[b], stride)]  # [spans, M]
        d = torch.cat([x[1:], R[b].expand(1, M)]) - x
        out.append(d.std(-1, unbiased=True) / math.sqrt(M))
    return torch.cat(out)


def _line_of(tokens: Sequence[str], length: int, p: int) -> str:
    """Which line of the response the span starting at token ``p`` opens in ("line k", or "last
    line"): a task-agnostic location (on ``chain``: step 1, step 2, the answer line)."""
    n = "".join(tokens[:length]).rstrip("\n").count("\n") + 1
    k = min("".join(tokens[:p]).count("\n") + 1, n)
    return "last line" if k == n else f"line {k}"


def claims(est: Dict[str, Any], specs: Sequence[str] = CLAIM_SPECS, *, credit_args: Sequence[str] = (),
           cfg: FidelityConfig = FidelityConfig()) -> Dict[str, Any]:
    """The numbers behind docs/fidelity.md's answers to the papers' token-level claims, over the
    complete trajectories of ``est`` whose true credit is not 0 everywhere (JSON-able). Where
    several spans tie for the largest |c| they share the place (:func:`top_weights`).

    * ``sparsity`` (PACT): per response, the share of ``sum |c|`` on its largest / first / last
      span, and the largest span's share for noise alone, ``(c_even - c_odd) / 2`` (the two
      halves' difference: the estimate's noise, no signal); the share of spans with
      ``|c| > 2 delta`` and with ``c < -delta``;
    * ``noise``: mean |c| per span against the standard error of V and of one span's c (as if its two
      V were independent, and from the paired continuations: :func:`paired_c_se`);
    * ``start_value``: V(h_0) of successful and failed responses (credit owed to the question);
    * ``last_span_c``: the mean true credit of the last span (answer line, end token);
    * ``largest_span_line``: in which line of the response the largest-|c| span opens;
    * ``taco_tail`` (TACO, on the batch's log-probs and entropy; None without them): in
      successful responses, tail tokens at TACO's default alpha, and the true credit of spans
      with and without a token whose surprisal exceeds the entropy (``r_t > log alpha``: TACO's
      risk without its threshold), with intervals that resample prompt groups;
    * ``placement``: per method, the share of its |A| on the span of largest |c| and on the last
      span (where the method puts its credit, against where c is).
    """
    from ...train.records import replay
    from ...credit.methods.taco import TACOConfig, tail_risk

    saved = est["rollouts"]
    sig = saved["signals"]
    lengths, stride, scored, success = scored_rows(est)
    groups = torch.as_tensor(sig["group_ids"]).tolist()
    V = span_values(est)
    c = {b: credit_spans(V[b]) for b in scored}
    rows = [b for b in scored if float(c[b].abs().sum()) > 0]  # c = 0 everywhere: nothing to place
    win = {b: success[b] for b in rows}
    Ve, Vo = span_values(est, "even"), span_values(est, "odd")
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else float("nan")  # noqa: E731
    top1 = {b: top_weights(c[b].abs(), 1) for b in rows}  # the largest-|c| span(s), ties shared

    def share(x, w):
        return float((x.abs() * w).sum() / x.abs().sum())

    noise = []
    for b in rows:
        e = (credit_spans(Ve[b]) - credit_spans(Vo[b])) / 2
        if float(e.abs().sum()) > 0:
            noise.append(float(e.abs().max() / e.abs().sum()))
    cs = torch.cat([c[b] for b in scored])
    se = torch.cat([standard_errors(est)[b] for b in scored])
    lines: Dict[str, float] = {}
    for b in rows:
        pos = mc_positions(lengths[b], stride)
        for j in torch.nonzero(top1[b]).flatten().tolist():
            where = _line_of(saved["tokens"][b], lengths[b], pos[j])
            lines[where] = lines.get(where, 0.0) + float(top1[b][j])

    alpha = TACOConfig().alpha
    taco_tail = None
    if sig.get("logprobs") is not None and sig.get("entropy") is not None:  # what TACO reads
        lp, H = torch.as_tensor(sig["logprobs"]).double(), torch.as_tensor(sig["entropy"]).double()
        risk = {b: tail_risk(lp[b, : lengths[b]], H[b, : lengths[b]], alpha) for b in rows if win[b]}

        def split(threshold):
            out = {True: ([], []), False: ([], [])}  # flagged -> (c values, their groups)
            for b, r in risk.items():
                for j, p in enumerate(mc_positions(lengths[b], stride)):
                    vals, gs = out[bool((r[p: p + stride] > threshold).any())]
                    vals.append(float(c[b][j]))
                    gs.append(groups[b])
            return out

        def spans(vals, gs):
            return {"n": len(vals), "mean_c": bootstrap_mean(vals, cfg, gs),
                    "share_below_minus_delta": mean([float(x < -cfg.delta) for x in vals]),
                    "share_above_delta": mean([float(x > cfg.delta) for x in vals])}

        tail, above = split(0.0), split(math.log(alpha))
        taco_tail = {"alpha": alpha, "tail_tokens": int(sum(int((r > 0).sum()) for r in risk.values())),
                     "surprisal_above_entropy_tokens": int(sum(int((r > math.log(alpha)).sum()) for r in risk.values())),
                     "tokens": int(sum(lengths[b] for b in risk)),
                     "spans_with_tail": spans(*tail[True]), "spans_without_tail": spans(*tail[False]),
                     "spans_surprisal_above_entropy": spans(*above[True]), "spans_other": spans(*above[False])}

    placement = {}
    for v, _ in with_own_critics(est, replay(saved, list(specs), credit_args=credit_args).views, credit_args):
        if v.spec in placement:
            continue
        top, last = [], []
        for b in rows:
            a = span_sums(v.advantages[b], lengths[b], stride)
            if float(a.abs().sum()) == 0:  # a group without a learning signal (GRPO-family A = 0)
                continue
            top.append(share(a, top1[b]))
            last.append(share(a, torch.nn.functional.one_hot(torch.tensor(a.numel() - 1), a.numel()).double()))
        placement[v.spec] = {"n": len(top), "on_largest_c_span": mean(top), "on_last_span": mean(last)}

    return {
        "trajectories": len(rows),
        "zero_credit_trajectories": len(scored) - len(rows),
        "successful": sum(win.values()),
        "stride": stride,
        "delta": cfg.delta,
        "sparsity": {"spans_per_response": mean([c[b].numel() for b in rows]),
                     "largest_span_share": mean([float(c[b].abs().max() / c[b].abs().sum()) for b in rows]),
                     "largest_span_share_noise_only": mean(noise),
                     "first_span_share": mean([float(c[b][0].abs() / c[b].abs().sum()) for b in rows]),
                     "last_span_share": mean([float(c[b][-1].abs() / c[b].abs().sum()) for b in rows]),
                     "share_abs_c_above_2delta": float((cs.abs() > 2 * cfg.delta).double().mean()),
                     "share_c_below_minus_delta": float((cs < -cfg.delta).double().mean())},
        "noise": {"mean_abs_c": float(cs.abs().mean()), "mean_se_v": float(se.mean()),
                  "se_span_c": math.sqrt(2) * float(se.mean()),
                  "se_span_c_paired": float(paired_c_se(est, scored).mean())},
        "start_value": {"all": mean([float(V[b][0]) for b in scored]),
                        "successes": mean([float(V[b][0]) for b in scored if success[b]]),
                        "failures": mean([float(V[b][0]) for b in scored if not success[b]])},
        "last_span_c": {"successes": mean([float(c[b][-1]) for b in scored if success[b]]),
                        "failures": mean([float(c[b][-1]) for b in scored if not success[b]])},
        "largest_span_line": dict(sorted(lines.items(), key=lambda kv: (kv[0] == "last line", kv[0]))),
        "taco_tail": taco_tail,
        "placement": placement,
    }


def format_claims(cl: Dict[str, Any]) -> str:
    sp, no, sv, tt = cl["sparsity"], cl["noise"], cl["start_value"], cl["taco_tail"]
    d, unit = cl["delta"], ("token" if cl["stride"] == 1 else "span")
    out = [
        f"numbers behind the claims ({cl['trajectories']} complete trajectories with some true credit, {cl['successful']} "
        f"successful; {cl['zero_credit_trajectories']} with c = 0 everywhere left out; credit per {unit}; ties share a place)",
        f"  sparsity: {sp['spans_per_response']:.1f} {unit}s per response; share of sum |c| on the largest {sp['largest_span_share']:.2f} "
        f"(noise alone: {sp['largest_span_share_noise_only']:.2f}), first {sp['first_span_share']:.2f}, last {sp['last_span_share']:.2f}; "
        f"{unit}s with |c| > {2 * d:g}: {sp['share_abs_c_above_2delta']:.2f}, with c < -{d:g}: {sp['share_c_below_minus_delta']:.2f}",
        f"  noise: mean |c| {no['mean_abs_c']:.3f}; mean SE of V {no['mean_se_v']:.3f} (SE of one {unit}'s c ~ {no['se_span_c']:.3f} "
        f"if its two V were independent; {no['se_span_c_paired']:.3f} from the paired continuations)",
        f"  V(h_0): all {sv['all']:.2f}, successes {sv['successes']:.2f}, failures {sv['failures']:.2f}",
        f"  last {unit}'s c: successes {cl['last_span_c']['successes']:.3f}, failures {cl['last_span_c']['failures']:.3f}",
        "  largest-|c| " + unit + " opens in: " + ", ".join(f"{k} {n:.1f}" for k, n in cl["largest_span_line"].items()),
    ]
    if tt is None:
        out.append("  TACO tail tokens: not counted (the batch has no log-probs and entropy)")
    else:
        def sp_(x):
            return (f"n {x['n']}, mean c {format_interval(x['mean_c'])}, share c < -{d:g} {x['share_below_minus_delta']:.2f}, "
                    f"> {d:g} {x['share_above_delta']:.2f}")

        out += [
            f"  TACO tail tokens (alpha {tt['alpha']:g}) in successful responses: {tt['tail_tokens']} of {tt['tokens']}",
            f"  their tokens with surprisal above the entropy: {tt['surprisal_above_entropy_tokens']}; {unit}s with one: "
            f"{sp_(tt['spans_surprisal_above_entropy'])}; other {unit}s: {sp_(tt['spans_other'])}",
        ]
    out.append(f"  where each method's |A| goes (share on the largest-|c| {unit}, on the last {unit}; n = trajectories with A != 0):")
    width = max(len(k) for k in cl["placement"]) + 2 if cl["placement"] else 8
    for spec, pl in cl["placement"].items():
        out.append(f"    {spec.ljust(width)}{pl['on_largest_c_span']:.2f}  {pl['on_last_span']:.2f}  (n {pl['n']})")
    return "\n".join(out)

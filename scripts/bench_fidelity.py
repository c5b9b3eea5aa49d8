"""Credit fidelity against headroom on a bench task (issue 30, item 4), at the seeds' initial policies.

    .venv/bin/python scripts/bench_fidelity.py --task keytok \\
        --summary docs/benchmark/summary_keytok_all.json -o OUT.json       # prints a Markdown table

For each seed of the summary: the seed's initial policy (:func:`tokencredit.analysis.bench_policy.bench_policy`,
the weights every spec of that seed started from), ``--samples`` responses to each eval question
sampled from it, the exact V of every prefix (:func:`tokencredit.analysis.fidelity.exact.exact_estimates`
over the task's alphabet; the bench policy never ends a response early, so the end token the
exact tier needs carries probability 0), and every spec's credit replayed on that batch and
scored against the exact true credit (:func:`tokencredit.analysis.fidelity.score`). Two signals the exact
tier does not write are added from what holds at step 0: ``true_values`` (the exact V itself, so
``oracle`` is replayed too and must score 1) and ``ref_logprobs`` (= the policy's log-probs: at
step 0 the reference is the policy). Specs that need a critic's values (gae, pact) or Monte Carlo
values (vineppo) exist only inside a run and are not scored.

Then, across the scored specs other than oracle, the Spearman rank correlation between a spec's
mean fidelity (per metric) and its headroom recovered ``(AUC_spec - AUC_grpo) / (AUC_oracle -
AUC_grpo)`` from the summary's per-seed AUCs, with a percentile interval over resamples of the
seeds (fidelity and headroom resampled together, paired by seed).

Only step 0 is scored: the bench keeps each run's last checkpoint only (``keep_last=1``), and a
step-0 batch is the same for every spec of a seed, so the fidelity it measures is each method's
credit rule on one policy, not along its own run.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path

import numpy as np
import torch

METRICS = ("sign_agreement", "rank_corr", "pivotal_mass")


def seed_fidelity(task: str, seed: int, specs, samples: int):
    from tokencredit.analysis.bench import SETTINGS
    from tokencredit.analysis.bench_policy import bench_policy
    from tokencredit.data.controlled import CONTROLLED, REWARDS, build
    from tokencredit.engine.exactvalue import alphabet_ids
    from tokencredit.analysis.fidelity.exact import exact_estimates
    from tokencredit.analysis.fidelity.metrics import score

    model, tok = bench_policy(task, seed)
    space = CONTROLLED[task].space
    _, ev = build(task, seed, 10**6, 64)
    eos = int(tok.eos_token_id)
    est = exact_estimates(model, tok, ev, REWARDS[task], samples=samples, max_new_tokens=space.length,
                          temperature=SETTINGS[task].temperature, seed=seed, allowed=alphabet_ids(tok, space) + [eos],
                          stop=[eos], policy=f"{task} seed {seed}, initial policy")
    sig = est["rollouts"]["signals"]
    sig["true_values"] = est["samples"][..., 0].float().nan_to_num(0.0)
    sig["ref_logprobs"] = sig["logprobs"].clone()
    res = score(est, specs)
    out = {r["method"]: {m: r[m]["mean"] for m in METRICS if isinstance(r.get(m), dict)} for r in res["rows"]}
    return out, [s["spec"] for s in res["skipped"]]


def spearman(x, y) -> float:
    """Spearman across specs (average ranks for ties; values equal to 9 decimals tie), NaN
    where fewer than 3 specs have both numbers or a side is constant."""
    from tokencredit.analysis.fidelity.metrics import spearman as rank_corr

    x, y = np.round(np.asarray(x, float), 9), np.round(np.asarray(y, float), 9)
    ok = np.isfinite(x) & np.isfinite(y)
    return rank_corr(torch.from_numpy(x[ok]), torch.from_numpy(y[ok]))


def correlate(fid, auc, specs, metric, n_boot=2000, seed=0):
    """``(rho, lo, hi, n_specs)``: Spearman across ``specs`` of mean fidelity vs headroom, and its
    seed-bootstrap interval. ``fid[spec]`` and ``auc[spec]`` are per-seed lists (paired)."""
    g, o = np.asarray(auc["grpo"], float), np.asarray(auc["oracle"], float)
    F = np.array([[fid[s][k].get(metric, float("nan")) for k in range(len(g))] for s in specs], float)
    A = np.array([auc[s] for s in specs], float)

    def rho(idx):
        den = np.mean(o[idx] - g[idx])
        head = (A[:, idx] - g[idx]).mean(1) / den if abs(den) > 1e-12 else np.full(len(specs), np.nan)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a spec undefined on every resampled seed: NaN
            f = np.nanmean(F[:, idx], 1)
        return spearman(f, head)

    n = len(g)
    est = rho(np.arange(n))
    rng = np.random.default_rng(seed)
    boots = np.array([rho(rng.integers(0, n, n)) for _ in range(n_boot)])
    boots = boots[np.isfinite(boots)]
    lo, hi = (np.quantile(boots, [0.025, 0.975]) if len(boots) else (float("nan"),) * 2)
    return est, float(lo), float(hi), int(np.isfinite(F).any(1).sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True)
    p.add_argument("--summary", required=True, help="a bench summary.json holding the task (per-seed AUCs of every spec)")
    p.add_argument("--samples", type=int, default=8, help="responses per eval question (the bench's group size)")
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    summ = json.loads(Path(a.summary).read_text())[a.task]
    seeds, specs = summ["seeds"], list(summ["specs"])
    auc = {s: summ["specs"][s]["per_seed_auc"] for s in specs}
    fid = {s: [] for s in specs}
    skipped = set()
    for k in seeds:
        per, sk = seed_fidelity(a.task, k, specs, a.samples)
        skipped |= set(sk)
        for s in specs:
            fid[s].append(per.get(s, {}))
        fid.setdefault("random", []).append(per.get("random", {}))
        print(f"seed {k}: scored", flush=True)
    scored = [s for s in specs if s not in skipped and s != "oracle"]
    out = {"task": a.task, "seeds": seeds, "samples": a.samples, "skipped": sorted(skipped), "scored": scored,
           "fidelity": fid, "correlation": {}}
    lines = [f"| spec | headroom | " + " | ".join(METRICS) + " |", "|---|---:|" + "---:|" * len(METRICS)]
    for s in ["oracle"] + scored + ["random"]:
        h = summ["specs"].get(s, {}).get("headroom") if s != "grpo" else (0.0,)
        cells = []
        for m in METRICS:
            v = [d.get(m, float("nan")) for d in fid[s]]
            cells.append(f"{np.nanmean(v):.3f}" if np.isfinite(v).any() else "–")
        lines.append(f"| `{s}` | {h[0]:.2f} |" if h else f"| `{s}` | – |")
        lines[-1] += " " + " | ".join(cells) + " |"
    lines.append("")
    for m in METRICS:
        r = correlate(fid, auc, scored, m)
        out["correlation"][m] = dict(zip(("rho", "lo", "hi", "n_specs"), r))
        txt = "undefined (a constant side)" if not math.isfinite(r[0]) else f"{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]"
        lines.append(f"Spearman(fidelity {m}, headroom) over {r[3]} specs: {txt}")
    Path(a.output).write_text(json.dumps(out, indent=1, default=float))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

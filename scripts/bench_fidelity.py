"""Credit fidelity against headroom on a bench task (issue 30, item 4): at the seeds' initial
policies, or along every run at the checkpoints the bench keeps.

    .venv/bin/python scripts/bench_fidelity.py --task keytok \\
        --summary docs/benchmark/summary_keytok_all.json -o OUT.json       # step 0 only
    .venv/bin/python scripts/bench_fidelity.py --task carry --runs BENCH_OUT -o OUT.json   # along the runs

Step 0 only (no ``--runs``): for each seed of the summary, the seed's initial policy
(:func:`tokencredit.analysis.bench_policy.bench_policy`, the weights every spec of that seed
started from), ``--samples`` responses to each eval question sampled from it, the exact V of
every prefix (:func:`tokencredit.analysis.fidelity.exact.exact_estimates` over the task's
alphabet; the bench policy never ends a response early, so the end token the exact tier needs
carries probability 0), and every spec's credit replayed on that batch and scored against the
exact true credit (:func:`tokencredit.analysis.fidelity.score`). Two signals the exact tier does
not write are added: ``true_values`` (the exact V itself, so ``oracle`` is replayed too and must
score 1) and ``ref_logprobs`` (the initial policy's log-probs of the batch: the bench's reference
model is the initial policy).

Along the runs (``--runs``: a bench output directory, whose ``summary.json`` gives the per-seed
AUCs): every run keeps its policy's weights at :func:`tokencredit.analysis.bench.kept_steps`
(``<run>/kept/step_XXXXXXXX/``, checkpoint folders, fixed before the runs: 0, 10, 20, 30, 40). At each kept step
of each run of each spec, a batch is sampled from that run's own policy at that step (the same
sampling seed for every spec of a (seed, step)), its exact V computed, and the spec's credit
replayed on it and scored against that checkpoint's exact true credit. Step 0 is the seed's
initial policy, the same for every spec, so it is one batch per seed. A spec's fidelity on a
seed is the mean over the kept steps.

Then, across the scored specs other than oracle, the Spearman rank correlation between a spec's
mean fidelity (per metric) and its headroom recovered ``(AUC_spec - AUC_grpo) / (AUC_oracle -
AUC_grpo)`` from the summary's per-seed AUCs, with a percentile interval over resamples of the
seeds (fidelity and headroom resampled together, paired by seed). Specs that need a critic's
values (gae, pact) or Monte Carlo values (vineppo) exist only inside a run and are not scored;
a method's state (STARE's controller) starts fresh at each replay.
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


def _ref_logprobs(ref, est, temperature: float) -> torch.Tensor:
    """The reference model's log-probs of the batch's response tokens (one batched forward)."""
    saved = est["rollouts"]
    pids, pmask = saved["prompt_ids"], saved["prompt_mask"]
    rids, rmask = saved["response_ids"], saved["signals"]["response_mask"]
    inp = torch.cat([pids, rids], 1)
    att = torch.cat([pmask, rmask], 1)
    pos = (att.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = ref(input_ids=inp, attention_mask=att, position_ids=pos).logits.double()
    P = pids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1:-1] / temperature, -1)
    return lp.gather(-1, rids.unsqueeze(-1)).squeeze(-1).float() * rmask


def batch_fidelity(task: str, seed: int, specs, samples: int, model, ref, *, sample_seed: int, label: str):
    """Every spec's credit on a batch sampled from ``model`` scored against its exact true credit:
    ``({spec: {metric: mean}}, skipped specs)``; ``ref`` gives ``ref_logprobs``."""
    from tokencredit.analysis.bench import SETTINGS
    from tokencredit.data.controlled import CONTROLLED, REWARDS, build
    from tokencredit.engine.exactvalue import alphabet_ids
    from tokencredit.analysis.fidelity.exact import exact_estimates
    from tokencredit.analysis.fidelity.metrics import score

    tok = _tokenizer()
    space = CONTROLLED[task].space
    _, ev = build(task, seed, 10**6, 64)
    eos = int(tok.eos_token_id)
    temp = SETTINGS[task].temperature
    est = exact_estimates(model, tok, ev, REWARDS[task], samples=samples, max_new_tokens=space.length,
                          temperature=temp, seed=sample_seed, allowed=alphabet_ids(tok, space) + [eos],
                          stop=[eos], policy=label, oracle=any("oracle_logprobs" in _needs(s) for s in specs))
    sig = est["rollouts"]["signals"]
    sig["true_values"] = est["samples"][..., 0].float().nan_to_num(0.0)
    sig["ref_logprobs"] = sig["logprobs"].clone() if ref is model else _ref_logprobs(ref, est, temp)
    res = score(est, specs)
    out = {r["method"]: {m: r[m]["mean"] for m in METRICS if isinstance(r.get(m), dict)} for r in res["rows"]}
    return out, [s["spec"] for s in res["skipped"]]


def _needs(spec: str) -> frozenset:
    """The signals a spec's methods declare (its pipeline's required signals)."""
    from tokencredit.credit.spec import CreditPipeline

    return CreditPipeline(spec).required_signals


def _tokenizer():
    from tokencredit.testing import tiny_tokenizer

    return tiny_tokenizer()


def seed_fidelity(task: str, seed: int, specs, samples: int):
    """Fidelity at the seed's initial policy (step 0)."""
    from tokencredit.analysis.bench_policy import bench_policy

    model, _ = bench_policy(task, seed)
    return batch_fidelity(task, seed, specs, samples, model, model, sample_seed=seed,
                          label=f"{task} seed {seed}, initial policy")


def kept_policy(runs: Path, task: str, spec: str, seed: int, step: int):
    """The policy a bench run kept at ``step`` (:func:`tokencredit.analysis.bench.load_kept`: checked)."""
    from tokencredit.analysis.bench import load_kept
    from tokencredit.analysis.bench_policy import bench_policy

    model, _ = bench_policy(task, seed, warm=False)
    load_kept(model, runs / task / spec / f"seed{seed}", step)
    model.eval()
    return model


def run_fidelity(runs: Path, task: str, seed: int, specs, samples: int, steps):
    """Fidelity along the runs of one seed: ``{step: ({spec: {metric: mean}}, skipped)}``. Step 0:
    one batch of the initial policy for every spec; a later step: per spec, a batch of that
    spec's own run at that step (sampling seed shared by the specs of the (seed, step))."""
    ref = kept_policy(runs, task, specs[0], seed, 0)  # the initial policy: the bench's reference model
    out = {0: batch_fidelity(task, seed, specs, samples, ref, ref, sample_seed=seed * 1000, label=f"{task} seed {seed}, step 0")}
    unscorable = set(out[0][1])  # what needs a run's critic or Monte Carlo values: skipped at every step
    for step in steps:
        if step == 0:
            continue
        per, skipped = {}, sorted(unscorable)
        for spec in (s for s in specs if s not in unscorable):
            model = kept_policy(runs, task, spec, seed, step)
            p, sk = batch_fidelity(task, seed, [spec], samples, model, ref, sample_seed=seed * 1000 + step,
                                   label=f"{task} seed {seed}, {spec} at step {step}")
            skipped += [x for x in sk if x not in skipped]
            if spec in p:
                per[spec] = p[spec]
            if spec == "grpo" and "random" in p:
                per["random"] = p["random"]
        out[step] = (per, skipped)
    return out


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


def _mean_over_steps(per_step, spec):
    """``{metric: mean over the kept steps}`` of one spec on one seed (steps where it is undefined left out)."""
    out = {}
    for m in METRICS:
        v = [d[0].get(spec, {}).get(m, float("nan")) for d in per_step.values()]
        if np.isfinite(v).any():
            out[m] = float(np.nanmean(v))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", required=True)
    p.add_argument("--summary", default=None, help="a bench summary.json holding the task (per-seed AUCs of every spec); "
                                                   "default with --runs: its summary.json")
    p.add_argument("--runs", default=None, help="a bench output directory: score each run at its kept checkpoints")
    p.add_argument("--seeds", default=None, help="with --runs: score only these seeds (comma-separated; default: the summary's)")
    p.add_argument("--samples", type=int, default=8, help="responses per eval question (the bench's group size)")
    p.add_argument("--cache", default=None, help="with --runs: a folder keeping each seed's scores "
                                                 "(<task>_seed<k>_samples<n>.json; a later call with more seeds reuses them)")
    p.add_argument("--headroom", default=None, help="a bench summary.json whose headroom the table's column shows (e.g. "
                                                   "one over more seeds than are scored); default: the --summary/--runs one. "
                                                   "The correlation always pairs fidelity and headroom on the scored seeds")
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.summary is None and a.runs is None:
        p.error("--summary: expected a summary.json (or --runs), got none")
    summ = json.loads(Path(a.summary or Path(a.runs) / "summary.json").read_text())[a.task]
    shown = json.loads(Path(a.headroom).read_text())[a.task] if a.headroom else summ
    seeds, specs = summ["seeds"], list(summ["specs"])
    if a.seeds is not None:
        want = [int(x) for x in a.seeds.split(",")]
        if not set(want) <= set(seeds):
            p.error(f"--seeds: expected seeds among {seeds}, got {want}")
        idx = [seeds.index(k) for k in want]
        seeds = want
    else:
        idx = list(range(len(seeds)))
    auc = {s: [summ["specs"][s]["per_seed_auc"][i] for i in idx] for s in specs}
    fid = {s: [] for s in specs}
    fid["random"] = []
    by_step = {}
    skipped = set()
    steps = None
    for k in seeds:
        if a.runs is None:
            per, sk = seed_fidelity(a.task, k, specs, a.samples)
            skipped |= set(sk)
            for s in specs + ["random"]:
                fid[s].append(per.get(s, {}))
        else:
            from tokencredit.analysis.bench import kept_steps

            steps = kept_steps(a.task, steps=summ["budget"])
            cached = Path(a.cache) / f"{a.task}_seed{k}_samples{a.samples}.json" if a.cache else None
            if cached is not None and cached.exists():
                per_step = {int(st): (v[0], v[1]) for st, v in json.loads(cached.read_text()).items()}
            else:
                per_step = run_fidelity(Path(a.runs), a.task, k, specs, a.samples, steps)
                if cached is not None:
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    cached.write_text(json.dumps({str(st): list(v) for st, v in per_step.items()}, default=float))
            if any(s not in per_step[0][0] and s not in per_step[0][1] for s in specs):
                p.error(f"--cache: {cached} scored other specs than {specs}; expected the same, or another folder")
            for st, (per, sk) in per_step.items():
                skipped |= set(sk)
                for s in specs + ["random"]:
                    by_step.setdefault(s, {}).setdefault(st, []).append(per.get(s, {}))
            for s in specs + ["random"]:
                fid[s].append(_mean_over_steps(per_step, s))
        print(f"seed {k}: scored", flush=True)
    scored = [s for s in specs if s not in skipped and s != "oracle"]
    out = {"task": a.task, "seeds": seeds, "samples": a.samples, "skipped": sorted(skipped), "scored": scored,
           "kept_steps": steps, "fidelity": fid, "fidelity_by_step": by_step, "correlation": {}}
    if a.headroom:
        out["headroom_from"] = a.headroom
    lines = [f"| spec | headroom | " + " | ".join(METRICS) + " |", "|---|---:|" + "---:|" * len(METRICS)]
    for s in ["oracle"] + scored + ["random"]:
        h = shown["specs"].get(s, {}).get("headroom") if s != "grpo" else (0.0,)
        cells = []
        for m in METRICS:
            v = [d.get(m, float("nan")) for d in fid[s]]
            cells.append(f"{np.nanmean(v):.3f}" if np.isfinite(v).any() else "–")
        lines.append(f"| `{s}` | {h[0]:.2f} |" if h else f"| `{s}` | – |")
        lines[-1] += " " + " | ".join(cells) + " |"
    if steps:
        lines += ["", "sign agreement at each kept step (mean over seeds):", "",
                  "| spec | " + " | ".join(f"step {st}" for st in steps) + " |", "|---|" + "---:|" * len(steps)]
        for s in ["oracle"] + scored + ["random"]:
            cells = []
            for st in steps:
                v = [d.get("sign_agreement", float("nan")) for d in by_step.get(s, {}).get(st, [])]
                cells.append(f"{np.nanmean(v):.3f}" if v and np.isfinite(v).any() else "–")
            lines.append(f"| `{s}` | " + " | ".join(cells) + " |")
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

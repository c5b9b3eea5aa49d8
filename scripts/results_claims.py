"""Check the papers' token-level claims on saved rollouts of a `tokencredit compare` run.

    .venv/bin/python scripts/results_claims.py runs/results            # prints a Markdown table

For each seed it takes the last saved eval batch of the ``arca`` runs (LoRA: every signal is
saved there, the adapter residual included) and replays every method on those identical
rollouts (``tokencredit.analysis.inspector.replay``). It prints per method: weight Gini and
effective-token ratio (ARCA's degeneracy diagnostics), the share of |credit| carried by the top
10% of tokens of each trajectory (OPPO's "credit concentrates on pivotal tokens"), and for TACO
the positive credit kept on tail tokens against the rest. It reads the training curves too:
STARE's gate and entropy against GRPO's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from tokencredit.analysis.compare import read_metrics
from tokencredit.analysis.inspector import find_rollouts, load_rollouts, replay, saved_batch
from tokencredit.credit.methods.taco import tail_risk

SPECS = ["grpo", "taco", "stare", "acpo", "arca", "surprisal", "entropy", "divergence", "oppo"]


def top_share(adv: torch.Tensor, mask: torch.Tensor, frac: float = 0.1) -> float:
    """Mean over trajectories with credit of: |credit| on the top ``frac`` of tokens / total."""
    shares = []
    for a, m in zip(adv.abs(), mask.bool()):
        v = a[m]
        if v.numel() == 0 or float(v.sum()) == 0.0:
            continue
        k = max(1, math.ceil(frac * v.numel()))
        shares.append(float(v.sort(descending=True).values[:k].sum() / v.sum()))
    return statistics.fmean(shares) if shares else float("nan")


def claims_on(rollouts: Path) -> dict:
    saved = load_rollouts(rollouts)
    insp = replay(saved, SPECS, include_saved=False)
    batch = saved_batch(saved)
    mask = batch.mask
    out = {"file": str(rollouts), "skipped": [(s.spec, s.missing or s.error) for s in insp.skipped], "methods": {}}
    grpo = next(v for v in insp.views if v.spec == "grpo")
    for v in insp.views:
        row = {
            "gini": v.diagnostics["diag/weight_gini"],
            "etr": v.diagnostics["diag/weight_etr"],
            "top10_share": top_share(v.advantages, mask),
        }
        out["methods"][v.spec] = row
        if v.spec == "grpo+taco":
            tail = (tail_risk(batch.logprobs, batch.entropy, 0.01) > 0) & mask
            pos = (grpo.advantages > 0) & mask
            ratio = torch.where(pos, v.advantages / grpo.advantages.where(pos, torch.ones_like(grpo.advantages)), torch.zeros_like(v.advantages))
            row["tail_frac_of_positive"] = float((tail & pos).sum() / pos.sum().clamp_min(1))
            row["kept_on_tail"] = float(ratio[tail & pos].mean()) if (tail & pos).any() else float("nan")
            row["kept_off_tail"] = float(ratio[~tail & pos].mean()) if (~tail & pos).any() else float("nan")
            row["negative_unchanged"] = bool(torch.equal(v.advantages[grpo.advantages < 0], grpo.advantages[grpo.advantages < 0]))
    return out


def curves(root: Path, spec: str, seeds) -> dict:
    res = {}
    for s in seeds:
        rows = read_metrics(root / spec / f"seed{s}" / "metrics.jsonl")
        ent = [r["entropy"] for r in rows if "entropy" in r]  # (compare.read_metrics reads entropy/mean of older runs as entropy)
        res[s] = {
            "entropy_first3": statistics.fmean(ent[:3]) if ent else float("nan"),
            "entropy_last3": statistics.fmean(ent[-3:]) if ent else float("nan"),
            "gate_on_frac": statistics.fmean([r["stare/gate"] for r in rows if "stare/gate" in r] or [float("nan")]),
        }
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root", type=Path)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--run", default="arca", help="whose saved rollouts to replay (needs every signal)")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    per_seed = [claims_on(find_rollouts(a.root / a.run / f"seed{s}")) for s in seeds]
    names = list(per_seed[0]["methods"])
    print(f"replayed on: {', '.join(r['file'] for r in per_seed)}")
    print(f"skipped: {per_seed[0]['skipped']}\n")
    print("| method | weight Gini | effective-token ratio | top-10% share of abs credit |")
    print("|---|---|---|---|")
    for n in names:
        vals = [[r["methods"][n][k] for r in per_seed] for k in ("gini", "etr", "top10_share")]
        print(f"| {n} | " + " | ".join(" / ".join(f"{x:.3f}" for x in v) for v in vals) + " |")
    print("\n(values: seed " + " / seed ".join(map(str, seeds)) + ")\n")
    for r in per_seed:
        t = r["methods"].get("grpo+taco", {})
        print(f"taco on {r['file']}: " + json.dumps({k: t[k] for k in t if k not in ('gini', 'etr', 'top10_share')}))
    for spec in ("grpo", "stare", "taco", "dapo"):
        if (a.root / spec).exists():
            print(f"{spec} entropy (first 3 steps -> last 3 steps), STARE gate-on fraction: {json.dumps(curves(a.root, spec, seeds))}")


if __name__ == "__main__":
    main()

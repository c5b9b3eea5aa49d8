"""The one-seed pilot that fixed ``bench.LORA.lr`` (the LoRA setting's learning rate), run
before any other spec trained in that setting: grpo and oracle only, seed 0, on the three
tasks, at each candidate learning rate (the LoRA bench otherwise as fixed in bench.LORA).

Rule, fixed before the pilot: the learning rate whose mean AUC of grpo and oracle over the
three tasks is highest (the baseline and the ceiling both learn as fast as the setting lets
them); one rate for every task.

    nice -n 19 .venv/bin/python scripts/bench_lora_pilot.py --output-dir OUT --lrs 3e-3,1e-2,3e-2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from tokencredit.analysis import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--lrs", default="3e-3,1e-2,3e-2")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rows = {}
    for lr in [float(x) for x in a.lrs.split(",")]:
        bench.LORA = dataclasses.replace(bench.LORA, lr=lr)  # read by task_settings in this process (workers=1)
        t0 = time.time()
        r = bench.run_bench(bench.SUITE, "grpo,oracle", str(a.seed), Path(a.output_dir) / f"lr{lr:g}", workers=1,
                            progress=False, policy="lora")
        per = {t: {s: r["summary"][t]["specs"][s]["auc"][0] for s in ("grpo", "oracle")} for t in bench.SUITE}
        rows[lr] = {"auc": per, "mean": sum(v for d in per.values() for v in d.values()) / 6, "wall_s": time.time() - t0}
        print(f"lr {lr:g}: " + "; ".join(f"{t} grpo {d['grpo']:.3f} oracle {d['oracle']:.3f}" for t, d in per.items())
              + f"; mean {rows[lr]['mean']:.3f} ({rows[lr]['wall_s']:.0f} s)", flush=True)
    best = max(rows, key=lambda k: rows[k]["mean"])
    print(f"chosen lr: {best:g}")
    (Path(a.output_dir) / "pilot.json").write_text(json.dumps({"rows": {str(k): v for k, v in rows.items()}, "chosen": best}, indent=2))


if __name__ == "__main__":
    main()

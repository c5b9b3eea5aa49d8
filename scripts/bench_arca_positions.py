"""ARCA's mean token weight by response position in a LoRA bench's grpo+arca runs, at their kept
step-40 adapters: per seed, one sample for each of 16 eval questions (torch seed 0 before the
first), the final hidden state's residual (adapter on vs off, at the states that predict each
response token, as the trainer's adapter-off pass takes it) normalised to mean 1 per response
(ARCA's weights at its defaults), averaged over the responses and then the seeds.

    PYTHONPATH=src nice -n 19 .venv/bin/python scripts/bench_arca_positions.py --runs OUT   # OUT: a `bench --policy lora` directory
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from tokencredit.analysis import bench
from tokencredit.analysis.compare import run_config
from tokencredit.data.controlled import CONTROLLED
from tokencredit.engine.models import adapter_disabled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9")
    ap.add_argument("--step", type=int, default=40)
    a = ap.parse_args()
    scratch = tempfile.mkdtemp()
    torch.manual_seed(0)
    for task in bench.SUITE:
        rows = []
        for seed in [int(s) for s in a.seeds.split(",")]:
            cfg = run_config(bench.bench_config(task, policy="lora"), "grpo+arca", seed, bench.task_dir(scratch, task, "lora"))
            tr = bench.make_trainer(cfg, init_dir=f"{a.runs}/init")
            bench.load_kept(tr.model, bench.task_dir(a.runs, task, "lora") / "grpo+arca" / f"seed{seed}", a.step)
            m, tok, n = tr.model, tr.tokenizer, CONTROLLED[task].space.length
            texts = [tok.apply_chat_template(list(e.messages), tokenize=False, add_generation_prompt=True) for e in list(tr.task.eval)[:16]]
            enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            with torch.no_grad():
                out = m.generate(**enc, do_sample=True, max_new_tokens=n, temperature=1.0, top_k=0)
                h_on = m(input_ids=out, output_hidden_states=True).hidden_states[-1][:, -n - 1:-1]
                with adapter_disabled(m):
                    h_off = m(input_ids=out, output_hidden_states=True).hidden_states[-1][:, -n - 1:-1]
            r = (h_on - h_off).norm(dim=-1)
            rows.append((r / r.mean(1, keepdim=True)).mean(0))
        w = torch.stack(rows).mean(0)
        print(f"{task}: mean ARCA weight by response position, step {a.step}: " + ", ".join(f"{float(x):.3f}" for x in w))


if __name__ == "__main__":
    main()

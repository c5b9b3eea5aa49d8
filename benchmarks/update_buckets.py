"""The update's forward + backward with and without length buckets (``forward_response(buckets=)``). (A script, not a test.)

The README job's update on the embedded SmolLM2-135M: 4 prompts of the mul1 task x 4 responses,
micro-batches of 8 rows (the default ``optim.micro_batch_size``), each micro-batch's
``forward_response`` -> ``token_signals`` (log-probs and entropy, as the update asks) -> a
masked mean of the log-probs, backward. The response lengths are the README run's own (its
saved rollouts at steps 10, 20 and 30, ``tokencredit train --credit taco``, 2026-12-07): one
length set per timed call, in turn. The two settings alternate within one process, ``--reps``
times each, so that the machine's drift falls on both; the ratio is of the medians.

    python benchmarks/update_buckets.py                      # fp32, 2 threads
    python benchmarks/update_buckets.py --precision bf16     # bf16 autocast, as --precision bf16 trains
    python benchmarks/update_buckets.py --scale 8            # the same spread at 8x the lengths (budget 256)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

#: the response lengths of the README run's three saved training batches (steps 10, 20, 30)
README_LENGTHS = (
    (20, 10, 32, 10, 8, 16, 18, 29, 32, 14, 22, 10, 4, 9, 7, 9),
    (8, 9, 10, 18, 32, 9, 9, 32, 9, 8, 9, 9, 9, 9, 9, 9),
    (9, 9, 9, 9, 10, 17, 9, 32, 23, 6, 17, 13, 9, 32, 23, 9),
)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
        isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
        return f"{name} ({', '.join(isa) or 'avx2'})"
    except Exception:  # noqa: BLE001 (a name for the report only)
        return platform.processor() or "unknown"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="rounds; each times every setting on each of the three length sets")
    p.add_argument("--micro-batches", default="8", help="comma-separated micro-batch sizes to time (rows per forward/backward)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--scale", type=int, default=1,
                   help="multiply the README run's lengths and budget by this (a longer-answer task's spread, same shape)")
    p.add_argument("--overheads", default=None,
                   help="comma-separated BUCKET_OVERHEAD values to time besides the default (a call's cost in positions)")
    args = p.parse_args(argv)

    import torch

    from tokencredit.data.tasks import make_task
    from tokencredit.engine.forward import forward_response
    from tokencredit.engine.models import EMBEDDED, resolve_model
    from tokencredit.engine.precision import autocast
    from tokencredit.engine.signals import token_signals

    torch.set_num_threads(args.threads)
    model, tok = resolve_model(EMBEDDED, dtype=torch.float32)
    model.float().train()
    task = make_task("mul1", seed=0)
    msgs = [list(task.train[i].messages) for i in range(4)]
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    idx = torch.arange(4).repeat_interleave(4)
    pid, pmask = enc["input_ids"][idx], enc["attention_mask"][idx]
    N, P = pid.shape
    T = args.max_new_tokens * args.scale
    g = torch.Generator().manual_seed(0)
    batches = []
    for lens in README_LENGTHS:
        lens = torch.tensor(lens) * args.scale
        rid = torch.randint(0, tok.vocab_size, (N, T), generator=g)
        rmask = (torch.arange(T)[None] < lens[:, None]).long()
        rid[rmask == 0] = tok.pad_token_id
        batches.append((torch.cat([pid, rid], 1), torch.cat([pmask, rmask], 1), rid, rmask))

    import tokencredit.engine.forward as fw

    def update(b, setting) -> float:
        """``setting``: (micro-batch size, False (padded) or the BUCKET_OVERHEAD to plan with)."""
        mb, buckets = setting
        ids, att, rid, rmask = b
        t = time.perf_counter()
        for s in range(0, N, mb):
            sl = slice(s, s + mb)
            with autocast(args.precision, "cpu"):
                fw.BUCKET_OVERHEAD = buckets if buckets is not False else default
                _, logits = forward_response(model, ids[sl], att[sl], P, buckets=buckets is not False)
            sig = token_signals(logits, rid[sl], want=("logprobs", "entropy"))
            m = rmask[sl]
            (-(sig["logprobs"] * m).sum() / rmask.sum()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    default = fw.BUCKET_OVERHEAD
    overheads = [False, default] + [int(x) for x in (args.overheads or "").split(",") if x and int(x) != default]
    settings = [(int(mb), o) for mb in args.micro_batches.split(",") for o in overheads]
    for s in settings:  # warm-up (allocator, kernels)
        update(batches[0], s)
    # every rep times every setting on every length set, the settings' order rotating per rep;
    # a setting's time is the sum over the three sets
    walls = {s: [] for s in settings}
    for r in range(args.reps):
        order = settings[r % len(settings):] + settings[: r % len(settings)]
        tot = {s: 0.0 for s in settings}
        for b in batches:
            for s in order:
                tot[s] += update(b, s)
        for s in settings:
            walls[s].append(tot[s])
    med = {k: statistics.median(v) for k, v in walls.items()}
    real = args.scale * sum(sum(x) for x in README_LENGTHS) / len(README_LENGTHS)
    print(f"cpu {cpu_name()}; torch {torch.__version__}; threads {args.threads}; precision {args.precision}")
    print(f"rows {N} (4 prompts x 4), prompt {P} positions, budget {T}; real response tokens per batch {real:.0f} of {N * T}")
    base = settings[0]
    for k in settings:
        name = f"micro-batch {k[0]}, " + ("padded" if k[1] is False else f"buckets (overhead {k[1]})")
        print(f"{name}: three batches' update {', '.join(f'{w:.2f}' for w in walls[k])} s, median {med[k]:.2f} s, "
              f"ratio to micro-batch {base[0]} padded {med[k] / med[base]:.2f}")
    print(f"ratio buckets/padded {med[(base[0], default)] / med[base]:.2f}")


if __name__ == "__main__":
    main()

"""Decode throughput of our rollout path against the machine's compute limit. (A script, not a test.)

In one run, on ``--threads`` torch threads (default 1: the limit below is per core):

1. GEMM throughput: a square ``--gemm-n`` matmul in fp32 and in bf16 (GFLOP/s, best of a few);
2. the compute limit of decoding: a decoded token costs about 2 x parameters FLOPs (every weight
   is multiplied once per token; the tied embedding counted once, as the LM head), so the limit
   is ``GEMM FLOP/s / (2 x params)`` tokens/s, with the bf16 GEMM rate (the machine's fastest);
3. ``HFRollout.generate`` (tokencredit's rollout path: shared prompt prefix, the neutral
   generation config, per-token log-probs) on the embedded SmolLM2-135M-Instruct, at batch 16,
   64 and 128 rows (``--batches``; rows = prompts x 4 samples, prompts from ``--task``), fp32
   and bf16 (``HFRollout(dtype=torch.bfloat16)``, what ``--precision bf16`` uses), sampling at
   temperature 1 up to ``--new-tokens`` tokens.

One line per batch size and precision: decode tokens/s (rows x decode steps the call ran, i.e.
what it computed, rows that had stopped included; prefill included in the wall time) and that rate as a fraction of the limit (and of the same
precision's own limit); the last line is ``fraction-of-limit batch=128 precision=bf16 X``.
On a machine shared with other jobs all rates drop together; the fractions are measured within
one run, against GEMM rates of the same run.

    python benchmarks/decode.py --quick          # ~2-4 minutes: 8 new tokens
    python benchmarks/decode.py                  # 32 new tokens
"""

from __future__ import annotations

import argparse
import time


def gemm_gflops(dtype, n: int, reps: int = 3, rounds: int = 3) -> float:
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 * reps / best / 1e9


def decode_rate(rollout, prompts, new_tokens: int, samples: int) -> tuple:
    """(tokens/s, tokens computed) of one ``generate`` call: rows x decode steps / wall time."""
    t = time.perf_counter()
    rb = rollout.generate(prompts, num_samples=samples, max_new_tokens=new_tokens, temperature=1.0, seed=0)
    dt = time.perf_counter() - t
    n = int(rb.response_ids.shape[0] * rb.response_ids.shape[1])
    return n / dt, n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 new tokens per row (a few minutes)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batches", default="16,64,128", help="rows per generate call, comma-separated")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (rows = prompts x samples)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gemm-n", type=int, default=1024)
    p.add_argument("--task", default="mul1")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens = 8

    import torch

    torch.set_num_threads(args.threads)
    from tokencredit.engine.models import EMBEDDED, resolve_model
    from tokencredit.engine.precision import cpu_has_bf16_units
    from tokencredit.engine.rollout import HFRollout
    from tokencredit.data.tasks import make_task

    batches = [int(b) for b in args.batches.split(",")]
    precisions = args.precisions.split(",")
    fp32 = gemm_gflops(torch.float32, args.gemm_n)
    bf16 = gemm_gflops(torch.bfloat16, args.gemm_n)
    model, tok = resolve_model(EMBEDDED, dtype=torch.float32)
    model.float()
    params = sum(p.numel() for p in model.parameters())
    flops_per_token = 2 * params
    limit = {"fp32": fp32 * 1e9 / flops_per_token, "bf16": bf16 * 1e9 / flops_per_token}
    print(f"threads {args.threads}; CPU bf16 matrix units: {cpu_has_bf16_units()}; load average {_load()}")
    print(f"gemm n={args.gemm_n} fp32 {fp32:.1f} GFLOP/s, bf16 {bf16:.1f} GFLOP/s (bf16/fp32 {bf16 / fp32:.2f}x)")
    print(f"model {EMBEDDED}: {params / 1e6:.1f}M parameters, {flops_per_token / 1e9:.3f} GFLOP per decoded token")
    fastest = max(limit, key=limit.get)  # bf16 where the CPU has bf16 units; fp32 where it emulates bf16
    print(f"compute limit: bf16 {limit['bf16']:.0f} tokens/s, fp32 {limit['fp32']:.0f} tokens/s (per {args.threads} thread(s)); "
          f"the limit is the faster, {fastest}")

    task = make_task(args.task, seed=0)
    rollout = {pr: HFRollout(model, tok, dtype=torch.bfloat16 if pr == "bf16" else None) for pr in precisions}
    res = {}
    for pr in precisions:  # warm-up (the bf16 copy is made here)
        decode_rate(rollout[pr], [list(task.train[0].messages)], 2, args.samples)
    for b in batches:
        n_prompts = max(1, b // args.samples)
        prompts = [list(task.train[i % len(task.train)].messages) for i in range(n_prompts)]
        for pr in precisions:
            rate, n = decode_rate(rollout[pr], prompts, args.new_tokens, args.samples)
            frac = rate / limit[fastest]
            print(f"batch={b} precision={pr} tokens/s {rate:.0f} ({n} tokens) fraction of the limit {frac:.3f}, "
                  f"of {pr} limit {rate / limit[pr]:.3f}", flush=True)
            res[b, pr] = rate
    # GEMM again after decoding: on a shared machine the limit is the better of the two rates
    fp32_end, bf16_end = gemm_gflops(torch.float32, args.gemm_n), gemm_gflops(torch.bfloat16, args.gemm_n)
    print(f"gemm again after decoding: fp32 {fp32_end:.1f}, bf16 {bf16_end:.1f} GFLOP/s")
    if bf16_end > bf16 or fp32_end > fp32:
        limit = {"fp32": max(fp32, fp32_end) * 1e9 / flops_per_token, "bf16": max(bf16, bf16_end) * 1e9 / flops_per_token}
        fastest = max(limit, key=limit.get)
        print(f"limit re-based on the better GEMM rates: bf16 {limit['bf16']:.0f}, fp32 {limit['fp32']:.0f} tokens/s; "
              "fractions: " + ", ".join(f"batch={b} {pr} {r / limit[fastest]:.3f}" for (b, pr), r in res.items()))
    for pr in precisions:
        if pr != precisions[0]:
            print(f"{pr}/{precisions[0]} speed-up: " + ", ".join(f"batch {b} {res[b, pr] / res[b, precisions[0]]:.2f}x" for b in batches))
    print(f"load average {_load()} (the machine was {'shared' if _busy() else 'quiet'})")
    b, pr = (128 if 128 in batches else batches[-1]), ("bf16" if "bf16" in precisions else precisions[-1])
    print(f"fraction-of-limit batch={b} precision={pr} {res[b, pr] / limit[fastest]:.3f}")


def _load() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def _busy() -> bool:
    import os

    try:
        return float(_load()) > (os.cpu_count() or 1) * 0.5
    except ValueError:
        return False


if __name__ == "__main__":
    main()

"""Decode throughput of our rollout backends against the machine's compute limit. (A script, not a test.)

In one run, on ``--threads`` torch threads (default 1: the limit below is per core):

1. GEMM throughput: a square ``--gemm-n`` matmul in fp32 and in bf16 (GFLOP/s, best of a few);
2. the compute limit of decoding: a decoded token costs about 2 x parameters FLOPs (every weight
   is multiplied once per token; the tied embedding counted once, as the LM head), so the limit
   is ``GEMM FLOP/s / (2 x params)`` tokens/s, with the faster GEMM's rate (bf16 on a CPU with
   bf16 matrix units; fp32 on one that emulates bf16, e.g. AVX2 only);
3. per backend (``--backends``; default: hf, plus vllm where the vllm package is importable, i.e.
   in ``.venv-vllm``), on the embedded SmolLM2-135M-Instruct, prompts from ``--task`` x 4 samples,
   temperature 1, top-p 1, up to ``--new-tokens`` tokens, each precision (``--precisions``;
   default fp32,bf16 where the CPU has bf16 matrix units, else fp32 alone: emulated bf16 runs at
   ~1 GFLOP/s and would take an hour here):

   * ``hf``: ``HFRollout.generate`` (tokencredit's transformers path: shared prompt prefix, the
     neutral generation config, per-token log-probs; bf16 = ``HFRollout(dtype=torch.bfloat16)``,
     what ``--precision bf16`` uses) at batch 16, 64 and 128 rows (``--batches``);
   * ``vllm``: ``VLLMRollout.generate`` (``rollout.backend=vllm``: an in-process vLLM engine in
     that dtype) at the largest batch only (its engine is built per precision, 7-45 s, printed
     apart with the time of a weight push).

   Each backend has a warm-up call first. Tokens/s counts what a call computed, over its wall
   time (prefill included): HF, rows x decode steps (``generate`` steps every row until the last
   stops, so rows that stopped count); vLLM, the tokens it generated (a stopped row costs nothing
   further in vLLM's scheduler).

One line per batch size, precision and backend, with the rate as a fraction of the limit (and of
the same precision's own limit). The last lines are
``fraction-of-limit batch=128 precision=P backend=hf X`` and ``... backend=vllm X`` (P: bf16 if
measured, else fp32), and ``fraction-of-limit batch=128 precision=P X``, the hf value (the line
earlier rounds printed). On a machine shared with other jobs all rates drop together; the
fractions are measured within one run, against GEMM rates of the same run (re-based on the
better of the rates before and after decoding).

    python benchmarks/decode.py --quick                    # 8 new tokens
    python benchmarks/decode.py                            # 32 new tokens
    .venv-vllm/bin/python benchmarks/decode.py             # the same, vLLM beside transformers
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
    """(tokens/s, tokens computed, seconds) of one ``generate`` call: tokens over wall time. HF:
    rows x decode steps (every row is stepped until the last stops); vLLM: the tokens generated."""
    t = time.perf_counter()
    rb = rollout.generate(prompts, num_samples=samples, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=0)
    dt = time.perf_counter() - t
    if hasattr(rollout, "llm"):  # VLLMRollout
        n = int(rb.response_mask.sum())
    else:
        n = int(rb.response_ids.shape[0] * rb.response_ids.shape[1])
    return n / dt, n, dt


def _default_backends() -> str:
    import importlib.util

    return "hf,vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 new tokens per row (a few minutes)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batches", default="16,64,128", help="rows per generate call, comma-separated (vllm: the largest)")
    p.add_argument("--precisions", default=None,
                   help="comma-separated; default fp32,bf16 where the CPU has bf16 matrix units, else fp32")
    p.add_argument("--backends", default=None,
                   help="comma-separated subset of hf,vllm; default hf, plus vllm where it is importable")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (rows = prompts x samples)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gemm-n", type=int, default=1024)
    p.add_argument("--task", default="mul1")
    p.add_argument("--vllm-compile", action="store_true",
                   help="build the vLLM engine without enforce_eager (vLLM compiles the model at the build: minutes)")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens = 8

    import torch

    torch.set_num_threads(args.threads)
    from tokencredit.engine.models import EMBEDDED, resolve_model
    from tokencredit.engine.precision import cpu_has_bf16_units
    from tokencredit.engine.rollout import HFRollout
    from tokencredit.data.tasks import make_task

    backends_note = "as asked"
    if args.backends is None:
        args.backends = _default_backends()
        backends_note = "default: vllm " + ("is importable" if "vllm" in args.backends else "is not importable here")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("hf", "vllm") for b in backends):
        p.error(f"--backends: expected a comma-separated subset of hf,vllm, got {args.backends!r}")
    if "vllm" in backends and _default_backends() == "hf":
        p.error("--backends: vllm asked for, but the vllm package is not importable here (use .venv-vllm/bin/python)")
    bf16_units = cpu_has_bf16_units()
    if args.precisions is None:
        args.precisions = "fp32,bf16" if bf16_units else "fp32"
    precisions = [x.strip() for x in args.precisions.split(",")]
    if any(x not in ("fp32", "bf16") for x in precisions):
        p.error(f"--precisions: expected a comma-separated subset of fp32,bf16, got {args.precisions!r}")
    batches = [int(b) for b in args.batches.split(",")]
    fp32 = gemm_gflops(torch.float32, args.gemm_n)
    bf16 = gemm_gflops(torch.bfloat16, args.gemm_n)
    model, tok = resolve_model(EMBEDDED, dtype=torch.float32)
    model.float()
    params = sum(p.numel() for p in model.parameters())
    flops_per_token = 2 * params
    limit = {"fp32": fp32 * 1e9 / flops_per_token, "bf16": bf16 * 1e9 / flops_per_token}
    print(f"threads {args.threads}; CPU bf16 matrix units: {bf16_units}; load average {_load()}")
    print(f"backends {','.join(backends)} ({backends_note}); precisions {','.join(precisions)}"
          + ("" if bf16_units or "bf16" in precisions else " (bf16 left out: no bf16 matrix units on this CPU)"))
    print(f"gemm n={args.gemm_n} fp32 {fp32:.1f} GFLOP/s, bf16 {bf16:.1f} GFLOP/s (bf16/fp32 {bf16 / fp32:.2f}x)")
    print(f"model {EMBEDDED}: {params / 1e6:.1f}M parameters, {flops_per_token / 1e9:.3f} GFLOP per decoded token")
    fastest = max(limit, key=limit.get)  # bf16 where the CPU has bf16 units; fp32 where it emulates bf16
    print(f"compute limit: bf16 {limit['bf16']:.0f} tokens/s, fp32 {limit['fp32']:.0f} tokens/s (per {args.threads} thread(s)); "
          f"the limit is the faster, {fastest}", flush=True)

    task = make_task(args.task, seed=0)

    def prompts_for(b):
        return [list(task.train[i % len(task.train)].messages) for i in range(max(1, b // args.samples))]

    res = {}
    if "hf" in backends:
        rollout = {pr: HFRollout(model, tok, dtype=torch.bfloat16 if pr == "bf16" else None) for pr in precisions}
        for pr in precisions:  # warm-up (the bf16 copy is made here)
            decode_rate(rollout[pr], prompts_for(1), 2, args.samples)
        for b in batches:
            for pr in precisions:
                rate, n, dt = decode_rate(rollout[pr], prompts_for(b), args.new_tokens, args.samples)
                print(f"backend=hf batch={b} precision={pr} tokens/s {rate:.0f} ({n} tokens, {dt:.1f} s) "
                      f"fraction of the limit {rate / limit[fastest]:.3f}, of {pr} limit {rate / limit[pr]:.3f}", flush=True)
                res["hf", b, pr] = rate
        del rollout
    if "vllm" in backends:
        from tokencredit.engine.rollout_vllm import VLLMRollout

        b = max(batches)
        for pr in precisions:
            r = VLLMRollout(model, tok, dtype=torch.bfloat16 if pr == "bf16" else torch.float32, max_num_seqs=max(b, 8),
                            enforce_eager=not args.vllm_compile)
            t = time.perf_counter()
            decode_rate(r, prompts_for(1), 2, args.samples)  # warm-up: the engine is built here
            build = time.perf_counter() - t
            rate, n, dt = decode_rate(r, prompts_for(b), args.new_tokens, args.samples)
            t = time.perf_counter()
            r.weights_changed()
            r.engine()  # a weight push, as after each optimizer step
            push = time.perf_counter() - t
            r.close()
            print(f"backend=vllm batch={b} precision={pr} tokens/s {rate:.0f} ({n} tokens, {dt:.1f} s; engine build "
                  f"{build:.1f} s, weight push {push:.2f} s) fraction of the limit {rate / limit[fastest]:.3f}, "
                  f"of {pr} limit {rate / limit[pr]:.3f}", flush=True)
            res["vllm", b, pr] = rate
    # GEMM again after decoding: on a shared machine the limit is the better of the two rates
    fp32_end, bf16_end = gemm_gflops(torch.float32, args.gemm_n), gemm_gflops(torch.bfloat16, args.gemm_n)
    print(f"gemm again after decoding: fp32 {fp32_end:.1f}, bf16 {bf16_end:.1f} GFLOP/s")
    if bf16_end > bf16 or fp32_end > fp32:
        limit = {"fp32": max(fp32, fp32_end) * 1e9 / flops_per_token, "bf16": max(bf16, bf16_end) * 1e9 / flops_per_token}
        fastest = max(limit, key=limit.get)
        print(f"limit re-based on the better GEMM rates: bf16 {limit['bf16']:.0f}, fp32 {limit['fp32']:.0f} tokens/s; "
              "fractions: " + ", ".join(f"{be} batch={b} {pr} {r / limit[fastest]:.3f}" for (be, b, pr), r in res.items()))
    for be in backends:
        for pr in precisions[1:]:
            common = [b for b in batches if (be, b, pr) in res and (be, b, precisions[0]) in res]
            if common:
                print(f"{be} {pr}/{precisions[0]} speed-up: "
                      + ", ".join(f"batch {b} {res[be, b, pr] / res[be, b, precisions[0]]:.2f}x" for b in common))
    b = 128 if 128 in batches else max(batches)
    for pr in precisions:
        if ("hf", b, pr) in res and ("vllm", b, pr) in res:
            print(f"ratio vllm/hf batch={b} precision={pr} {res['vllm', b, pr] / res['hf', b, pr]:.2f}")
    print(f"load average {_load()} (the machine was {'shared' if _busy() else 'quiet'})")
    pr = "bf16" if "bf16" in precisions else precisions[-1]
    for be in backends:
        if (be, b, pr) in res:
            print(f"fraction-of-limit batch={b} precision={pr} backend={be} {res[be, b, pr] / limit[fastest]:.3f}")
    if ("hf", b, pr) in res:
        print(f"fraction-of-limit batch={b} precision={pr} {res['hf', b, pr] / limit[fastest]:.3f}")


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

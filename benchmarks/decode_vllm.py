"""Decode throughput of the vLLM rollout backend against HFRollout, batch 128. (A script, not a test.)

Runs in the environment with the vllm extra (``.venv-vllm``). In one run, on ``--threads``
torch threads (default 1, as benchmarks/decode.py):

1. GEMM rates and the decode compute limit as benchmarks/decode.py computes them (2 x parameters
   FLOPs per token, at the faster of the fp32 / bf16 GEMM rates);
2. ``VLLMRollout.generate`` and ``HFRollout.generate`` on the embedded SmolLM2-135M-Instruct,
   ``--batch`` rows (prompts x 4 samples, prompts of ``--task``), temperature 1, up to
   ``--new-tokens`` tokens, fp32 and bf16, each after a warm-up call (vLLM's engine is built
   and its kernels first run there; the build time is printed apart).

Tokens/s counts what each call computed: rows x decode steps (HFRollout: the padded length, since
generate steps every row until the last one stops; vLLM: the tokens it generated, a stopped row
costs nothing further) over the call's wall time, prefill included. Both are printed, and the
ratio of vLLM to HF on each.

    .venv-vllm/bin/python benchmarks/decode_vllm.py --quick   # 8 new tokens
    .venv-vllm/bin/python benchmarks/decode_vllm.py           # 32 new tokens
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 new tokens per row")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=128, help="rows per generate call")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gemm-n", type=int, default=1024)
    p.add_argument("--task", default="mul1")
    p.add_argument("--skip-hf", action="store_true", help="time only the vLLM backend")
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens = 8

    import torch

    torch.set_num_threads(args.threads)
    from decode import _load, gemm_gflops

    from tokencredit.engine.models import EMBEDDED, resolve_model
    from tokencredit.engine.rollout import HFRollout
    from tokencredit.engine.rollout_vllm import VLLMRollout
    from tokencredit.data.tasks import make_task

    fp32, bf16 = gemm_gflops(torch.float32, args.gemm_n), gemm_gflops(torch.bfloat16, args.gemm_n)
    model, tok = resolve_model(EMBEDDED, dtype=torch.float32)
    model.float()
    params = sum(p.numel() for p in model.parameters())
    limit = max(fp32, bf16) * 1e9 / (2 * params)
    print(f"threads {args.threads}; load average {_load()}; gemm fp32 {fp32:.1f}, bf16 {bf16:.1f} GFLOP/s; "
          f"{EMBEDDED} {params / 1e6:.1f}M parameters; compute limit {limit:.0f} tokens/s")
    task = make_task(args.task, seed=0)
    n_prompts = max(1, args.batch // args.samples)
    prompts = [list(task.train[i % len(task.train)].messages) for i in range(n_prompts)]
    kw = dict(num_samples=args.samples, max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, seed=0)
    res = {}
    for pr in args.precisions.split(","):
        dtype = torch.bfloat16 if pr == "bf16" else torch.float32
        backends = [("vllm", VLLMRollout(model, tok, dtype=dtype, max_num_seqs=max(args.batch, 8)))]
        if not args.skip_hf:
            backends.append(("hf", HFRollout(model, tok, dtype=dtype if pr == "bf16" else None, max_batch_size=args.batch)))
        for name, r in backends:
            t = time.perf_counter()
            r.generate(prompts[:1], **dict(kw, max_new_tokens=2))  # warm-up (vLLM: the engine is built here)
            warm = time.perf_counter() - t
            t = time.perf_counter()
            rb = r.generate(prompts, **kw)
            dt = time.perf_counter() - t
            n = int(rb.response_mask.sum()) if name == "vllm" else int(rb.response_ids.numel())
            res[name, pr] = n / dt
            print(f"backend={name} batch={len(rb)} precision={pr} tokens/s {n / dt:.0f} ({n} tokens, {dt:.2f} s; "
                  f"warm-up {warm:.1f} s) fraction of the limit {n / dt / limit:.3f}", flush=True)
            if name == "vllm":
                t = time.perf_counter()
                r.weights_changed()
                r.engine()
                print(f"backend=vllm precision={pr} weight push {time.perf_counter() - t:.2f} s", flush=True)
                r.close()
        if ("hf", pr) in res:
            print(f"ratio vllm/hf batch={args.batch} precision={pr} {res['vllm', pr] / res['hf', pr]:.2f}")
    print(f"load average {_load()}")
    if ("vllm", "bf16") in res:
        print(f"fraction-of-limit batch={args.batch} precision=bf16 backend=vllm {res['vllm', 'bf16'] / limit:.3f}")


if __name__ == "__main__":
    main()

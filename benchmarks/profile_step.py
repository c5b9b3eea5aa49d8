"""Where a decode step of ``HFRollout.generate`` goes: a torch.profiler table by kind of work. (A script, not a test.)

One ``generate`` call on the embedded SmolLM2-135M (rows = prompts x ``--samples``, ``--new-tokens``
new tokens, temperature 1, fp32, ``--threads`` torch threads), profiled with ``torch.profiler``;
each aten op's self CPU time is put in a bucket:

    matmul       mm / addmm / bmm / linear's matmuls (every weight; the LM head)
    attention    scaled_dot_product_attention's kernels (and eager attention's softmax)
    kv cache     the cache's cat / copies / index (DynamicCache grows by cat every step)
    norm/act     RMSNorm (pow, mean, rsqrt, mul), SiLU, the residual adds, rotary embeddings
    sampler      the rollout's logits processors (finite check, log-prob record, inverse-CDF draw)
    other ops    anything else aten runs (embedding, masks, views, ...)
    python       the call's wall time no aten op accounts for (generate's loop, module calls)

The processors are timed by wrapping them in ``record_function`` (``sampler``); the rest is by op
name. The wall time of the same call without the profiler is printed too (the profiler adds
overhead per op). ``--what update`` profiles one forward + backward of the policy loss's forward
(``forward_response``) on the README job's shapes instead, and prints its fraction of the GEMM rate.

    python benchmarks/profile_step.py --batch 128
    python benchmarks/profile_step.py --what update --rows 16
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_mkldnn")
ATTN = ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_softmax", "aten::softmax")
CACHE = ("aten::cat", "aten::index_select", "aten::index", "aten::copy_", "aten::clone", "aten::index_copy", "aten::contiguous")
NORM = ("aten::pow", "aten::mean", "aten::rsqrt", "aten::mul", "aten::silu", "aten::add", "aten::neg", "aten::cos",
        "aten::sin", "aten::to", "aten::_to_copy", "aten::rms_norm", "aten::_fused_rms_norm", "aten::div")


def bucket(name: str) -> str:
    if name.startswith(MATMUL):
        return "matmul"
    if name.startswith(ATTN):
        return "attention"
    if name.startswith(CACHE):
        return "kv cache / copies"
    if name.startswith(NORM):
        return "norm/act/rotary"
    return "other ops"


def table(prof, wall: float, extra_roots=("sampler",)) -> dict:
    """Self CPU time by bucket; ops under a ``sampler`` record_function go to ``sampler``."""
    out = defaultdict(float)
    # walk the event tree: an op whose ancestor is a "sampler" range counts as sampler
    events = prof.events()
    for e in events:
        if e.name in extra_roots and e.cpu_parent is None:
            pass
    def under(e, root):
        p = e.cpu_parent
        while p is not None:
            if p.name == root:
                return True
            p = p.cpu_parent
        return False
    for e in events:
        if e.name in extra_roots or not e.name.startswith("aten::"):
            continue
        self_us = e.self_cpu_time_total
        key = next((r for r in extra_roots if under(e, r)), None) or bucket(e.name)
        out[key] += self_us / 1e6
    out["python / generate loop"] = max(0.0, wall - sum(out.values()))
    return dict(out)


def profile_decode(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from tokencredit.data.tasks import make_task
    from tokencredit.engine import rollout as R
    from tokencredit.engine.models import EMBEDDED, resolve_model

    model, tok = resolve_model(EMBEDDED, dtype=torch.float32)
    model.float()
    task = make_task("mul1", seed=0)
    n_prompts = max(1, args.batch // args.samples)
    prompts = [list(task.train[i % len(task.train)].messages) for i in range(n_prompts)]
    ro = R.HFRollout(model, tok, max_batch_size=args.batch, **({"sampler": args.sampler} if args.sampler else {}))
    ro.generate(prompts[:1], num_samples=args.samples, max_new_tokens=2, temperature=1.0, seed=0)  # warm-up

    # processors timed as "sampler"
    orig_fc, orig_sp = R.finite_check_processor, R._sampling_processors

    def timed(p):
        class _T:
            def __call__(self, input_ids, scores):
                with record_function("sampler"):
                    return p(input_ids, scores)

            def __getattr__(self, k):
                return getattr(p, k)
        return _T()

    def run(profiled: bool):
        t = time.perf_counter()
        rb = ro.generate(prompts, num_samples=args.samples, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
        return time.perf_counter() - t, rb

    plain, rb = run(False)
    steps = rb.response_ids.shape[1]
    print(f"batch {args.batch} fp32 threads {args.threads}: {steps} decode steps, wall {plain:.2f} s without the profiler, "
          f"{rb.response_ids.numel() / plain:.1f} tokens/s, {plain / steps * 1e3:.0f} ms/step")
    R.finite_check_processor = lambda: timed(orig_fc())
    R._sampling_processors = lambda *a, **k: [timed(p) for p in orig_sp(*a, **k)]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall, rb = run(True)
    finally:
        R.finite_check_processor, R._sampling_processors = orig_fc, orig_sp
    t = table(prof, wall)
    print(f"profiled wall {wall:.2f} s ({wall / steps * 1e3:.0f} ms/step)")
    print("| where | s | ms/step | share |\n|---|---|---|---|")
    for k, v in sorted(t.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v:.2f} | {v / steps * 1e3:.1f} | {v / wall:.0%} |")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


def profile_update(args) -> None:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from tokencredit.data.tasks import make_task
    from tokencredit.engine.forward import forward_response
    from tokencredit.engine.models import EMBEDDED, resolve_model

    model, tok = resolve_model(EMBEDDED, dtype=torch.float32)
    model.float().train()
    task = make_task("mul1", seed=0)
    g = torch.Generator().manual_seed(0)
    msgs = [list(task.train[i].messages) for i in range(args.rows // 4)]
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    idx = torch.arange(len(msgs)).repeat_interleave(4)
    pid, pmask = enc["input_ids"][idx], enc["attention_mask"][idx]
    N, P = pid.shape
    T = args.new_tokens
    lens = torch.randint(T // 4, T + 1, (N,), generator=g)
    rid = torch.randint(0, 49152, (N, T), generator=g)
    rmask = (torch.arange(T)[None] < lens[:, None]).long()
    ids, att = torch.cat([pid, rid], 1), torch.cat([pmask, rmask], 1)
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    L = ids.shape[1]
    # what the code computes (forward_response): each distinct prompt's P positions once (padding
    # included; rows share their prompt's pass), every row's T response positions (padding
    # included), the LM head at the T positions that predict response tokens; backward = 2 x forward
    body = 2 * (params - emb) * (len(msgs) * P + N * T)
    head = 2 * emb * N * T
    flops = 3 * (body + head)

    def step():
        _, logits = forward_response(model, ids, att, P)
        lp = F.log_softmax(logits.float(), -1).gather(-1, rid.unsqueeze(-1)).squeeze(-1)
        (-(lp * rmask).sum() / rmask.sum()).backward()
        model.zero_grad(set_to_none=True)

    step()
    walls = []
    for _ in range(args.reps):
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
    wall = min(walls)
    n = 1024
    a = torch.randn(n, n); b = torch.randn(n, n); a @ b
    t = time.perf_counter()
    for _ in range(3):
        a @ b
    gemm = 2 * n**3 * 3 / (time.perf_counter() - t) / 1e9
    print(f"update rows {N} ({len(msgs)} distinct prompts), prompt {P} + {T} new = {L} positions; body positions computed "
          f"{len(msgs) * P + N * T}, of them real {int(pmask[::4].sum() + rmask.sum())}")
    print(f"FLOPs forward+backward {flops / 1e9:.1f} GFLOP (body {3 * body / 1e9:.1f}, LM head {3 * head / 1e9:.1f}); "
          f"walls {', '.join(f'{w:.2f}' for w in walls)} s; best {flops / wall / 1e9:.1f} GFLOP/s; "
          f"gemm n={n} {gemm:.1f} GFLOP/s; fraction of the GEMM rate {flops / wall / 1e9 / gemm:.2f}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        step()
        pw = time.perf_counter() - t
    tb = table(prof, pw, extra_roots=())
    print("| where | s | share |\n|---|---|---|")
    for k, v in sorted(tb.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v:.2f} | {v / pw:.0%} |")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--what", choices=("decode", "update"), default="decode")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rows", type=int, default=16, help="update: rows (prompts x 4)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sampler", default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    (profile_decode if args.what == "decode" else profile_update)(args)


if __name__ == "__main__":
    main()

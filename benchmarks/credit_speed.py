"""How much do credit methods and per-token signals cost? (A script, not a test.)

Part 1 - credit methods. Every registered method (``tokencredit.list_methods()``; a calibrator
by its bare name, i.e. paired with its paper's estimator, usually ``grpo+<name>``) runs on one
large synthetic ``CreditBatch`` carrying every signal. Each is timed against the plain GRPO
broadcast measured in the same run, and against one forward+backward of a 135M-parameter model
on the same tokens. The model cost is an **extrapolation**: a randomly initialised
``LlamaForCausalLM`` with SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 kv heads,
intermediate 1536, vocab 49152, tied embeddings) is timed on ``--model-tokens`` tokens and
scaled linearly to the batch's *valid* response tokens. Both simplifications (no prompt tokens,
no quadratic attention growth at long context) make the model look cheaper than it is, so the
"% of model" column errs on the high side.

Part 2 - fused signals. ``token_signals`` (chunked, custom backward) against the naive
whole-batch ``log_softmax`` on ``[N, V]`` logits, without grad and with forward+backward of
``sum(logprobs) + sum(entropy)``: time (in this process, best of ``--repeats``) and peak extra
memory. Peak memory is measured in a fresh subprocess per variant so that allocator caches of
one variant do not hide another's: on CPU, resident-set high-water mark (``VmHWM``, reset via
``/proc/self/clear_refs`` after the logits are built and a tiny warm-up call) minus the resident
set before the call, with glibc's mmap threshold fixed at 64 KiB so that a freed buffer leaves
the resident set (a second column repeats it with glibc's default, which keeps freed buffers
resident and so also counts allocator caching); on CUDA, ``torch.cuda.max_memory_allocated`` minus the allocation before the call. The figure
is printed as a multiple of the logits' own memory, so ``1 + extra`` is the peak total while the
signals are computed (target <= 1.25x). For forward+backward the gradient of the logits itself
(1x, unavoidable whatever the method) is included in "extra" and also shown separately.

    python benchmarks/credit_speed.py             # minutes on 2 CPU cores
    python benchmarks/credit_speed.py --full      # the 256 x 4096 setting, [4096, 32768] logits
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int, warmup: int = 1):
    """(median, min) seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


# ---- part 1: credit methods ------------------------------------------------------------


def synthetic_batch(B: int, T: int, group_size: int, device: str, seed: int = 0):
    """A valid CreditBatch with every signal; token signals come from real small-vocab
    distributions (so entropy, mode_prob and logprobs are mutually consistent)."""
    from tokencredit import CreditBatch
    from tokencredit.engine.signals import token_signals

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, T // 4), T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    rewards[0::group_size] = 1.0  # every group mixed, so group-normalised advantages are non-zero
    rewards[1::group_size] = 0.0
    group_ids = torch.arange(B) // group_size
    V = 16
    logits = torch.randn(B, T, V, generator=g) * 2.0
    probs = torch.softmax(logits, -1)
    tokens = torch.multinomial(probs.view(-1, V), 1, generator=g).view(B, T)
    sig = token_signals(logits, tokens)
    lp = sig["logprobs"]

    def near(scale):
        return (lp + scale * torch.randn(B, T, generator=g)).clamp_max(0.0)

    batch = CreditBatch(
        response_mask=mask.to(device),
        rewards=rewards.to(device),
        group_ids=group_ids.to(device),
        logprobs=lp.to(device),
        old_logprobs=near(0.05).to(device),
        ref_logprobs=near(0.3).to(device),
        entropy=sig["entropy"].to(device),
        mode_prob=sig["mode_prob"].to(device),
        hidden_residual=(3.0 * torch.rand(B, T, generator=g)).to(device),
        oracle_logprobs=near(1.0).to(device),
        values=torch.rand(B, T + 1, generator=g).to(device),
    )
    return batch


def time_methods(batch, device: str, repeats: int):
    """{spec: (resolved name, median s, error or None)} for every registered method."""
    import tokencredit as tc

    rows = {}
    for name in tc.list_methods():
        try:
            pipe = tc.CreditPipeline(name)
            med, _ = _time(lambda: pipe(batch), device, repeats)
            rows[name] = (pipe.name, med, None)
        except Exception as e:  # report and go on: one broken method must not hide the others
            rows[name] = (name, float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:70]}")
    return rows


def time_model(n_tokens: int, device: str, repeats: int, seq_len: int):
    """Seconds per token of one forward+backward of a random SmolLM2-135M-shaped model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    seq = min(seq_len, n_tokens)
    rows = max(1, n_tokens // seq)
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (rows, seq), device=device)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()

    med, _ = _time(step, device, repeats)
    del model
    return med / (rows * seq), n_params, rows * seq


def part1(args):
    print(f"== part 1: credit methods on B={args.batch} x T={args.seq} (group size {args.group_size}), device {args.device}")
    t0 = time.perf_counter()
    batch = synthetic_batch(args.batch, args.seq, args.group_size, args.device)
    n_valid = int(batch.mask.sum())
    print(f"   synthetic batch: {args.batch * args.seq} positions, {n_valid} valid tokens, built in {time.perf_counter() - t0:.1f} s")
    rows = time_methods(batch, args.device, args.repeats)
    base = rows.get("grpo", (None, float("nan"), "grpo not registered"))[1]

    model_ms = None
    if not args.skip_model:
        per_tok, n_params, measured = time_model(args.model_tokens, args.device, max(1, args.model_repeats), args.model_seq)
        model_ms = per_tok * n_valid * 1e3
        print(
            f"   model fwd+bwd: {n_params / 1e6:.0f}M params, measured on {measured} tokens "
            f"({per_tok * 1e3:.2f} ms/token); EXTRAPOLATED linearly to {n_valid} valid tokens: {model_ms / 1e3:.1f} s"
        )

    head = f"   {'spec':<22} {'ms':>10} {'x grpo':>8}"
    if model_ms is not None:
        head += f" {'% model':>9} {'extra %':>8}"
    print(head)
    for name, (resolved, sec, err) in rows.items():
        if err is not None:
            print(f"   {resolved:<22} {'-':>10} {'-':>8}  error: {err}")
            continue
        line = f"   {resolved:<22} {sec * 1e3:>10.2f} {sec / base:>8.2f}"
        if model_ms is not None:
            pct = 100.0 * sec * 1e3 / model_ms
            extra = 100.0 * (sec - base) * 1e3 / model_ms
            flag = "" if pct < 2.0 else "  (>= 2% target)"
            line += f" {pct:>8.3f}% {extra:>7.3f}%{flag}"
        print(line)
    if model_ms is not None:
        print("   % model: the method's time / extrapolated model fwd+bwd on the same valid tokens (target < 2%);")
        print("   extra %: the same, less the GRPO broadcast every method replaces.")


# ---- part 2: fused signals vs naive log_softmax --------------------------------------


def _naive(logits, tokens):
    lsm = torch.log_softmax(logits, -1)
    p = lsm.exp()
    return {
        "logprobs": lsm.gather(-1, tokens.unsqueeze(-1)).squeeze(-1),
        "entropy": -(p * lsm).sum(-1),
        "mode_prob": p.amax(-1),
    }


def _variant(name: str):
    from tokencredit.engine.signals import token_signals

    if name.startswith("naive"):
        return lambda x, y: _naive(x, y)
    return lambda x, y: {k: v.view(-1) for k, v in token_signals(x.unsqueeze(0), y.unsqueeze(0)).items()}


VARIANTS = ("naive", "fused", "naive_grad", "fused_grad")


def _run_variant(name: str, logits: torch.Tensor, tokens: torch.Tensor):
    fn = _variant(name)
    if name.endswith("_grad"):
        x = logits.detach().requires_grad_()
        out = fn(x, tokens)
        (out["logprobs"].sum() + out["entropy"].sum()).backward()
        return x.grad
    with torch.no_grad():
        return fn(logits, tokens)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def child_measure(args) -> None:
    """One variant, once, in this fresh process; prints a JSON line of peak extra bytes."""
    torch.manual_seed(0)
    dev = args.device
    logits = torch.randn(args.rows, args.vocab, device=dev)
    tokens = torch.randint(0, args.vocab, (args.rows,), device=dev)
    # a tiny call first: imports, thread pools and the kernels' code pages become resident
    # before the baseline, so the measurement sees the variant's data, not first-use costs
    _run_variant(args.child, logits[:2].clone(), tokens[:2].clone())
    logits_bytes = logits.numel() * logits.element_size()
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        res = _run_variant(args.child, logits, tokens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        how = "cuda max_memory_allocated"
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            before = _status_kb("VmRSS") * 1024
            res = _run_variant(args.child, logits, tokens)
            peak = _status_kb("VmHWM") * 1024 - before
            how = "VmHWM - VmRSS (clear_refs reset)"
        except OSError:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            res = _run_variant(args.child, logits, tokens)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            how = "ru_maxrss delta (a lower bound)"
    grad_bytes = res.numel() * res.element_size() if isinstance(res, torch.Tensor) else 0
    print(json.dumps({"peak_extra": peak, "logits": logits_bytes, "grad": grad_bytes, "how": how}))


def measure_memory(name: str, args, fixed_mmap: bool = True):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--rows", str(args.rows),
           "--vocab", str(args.vocab), "--device", args.device]
    env = os.environ.copy()
    if fixed_mmap:
        # glibc raises its mmap threshold after each large free (up to 32 MiB), after which freed
        # chunk buffers stay in the heap and count as resident: a fixed 64 KiB threshold gives
        # every tensor its own mapping, returned on free, so the high-water mark is live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:100]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def part2(args):
    from tokencredit.engine.signals import default_chunk_rows

    N, V = args.rows, args.vocab
    print(f"\n== part 2: signals (logprobs, entropy, mode_prob) on [{N}, {V}] float32 logits, device {args.device}")
    print(f"   fused default chunk: {default_chunk_rows(N, V, torch.float32)} rows")
    torch.manual_seed(0)
    logits = torch.randn(N, V, device=args.device)
    tokens = torch.randint(0, V, (N,), device=args.device)
    # both agree (a sanity check of what is being timed)
    with torch.no_grad():
        a, b = _variant("naive")(logits, tokens), _variant("fused")(logits, tokens)
    err = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"   max |fused - naive| over the three signals: {err:.2e}")
    cpu = not args.device.startswith("cuda")
    print(f"   {'variant':<12} {'ms':>9} {'peak extra/logits':>18} {'peak total/logits':>18}"
          + (f" {'total, default malloc':>22}" if cpu else "") + "  note")
    times, mem = {}, {}
    for name in VARIANTS:
        med, _ = _time(lambda: _run_variant(name, logits, tokens), args.device, args.repeats)
        times[name] = med
        mem = measure_memory(name, args)
        if "error" in mem:
            print(f"   {name:<12} {med * 1e3:>9.1f} {'-':>18} {'-':>18}  memory run failed: {mem['error']}")
            continue
        extra = mem["peak_extra"] / mem["logits"]
        line = f"   {name:<12} {med * 1e3:>9.1f} {extra:>17.2f}x {1 + extra:>17.2f}x"
        if cpu:
            dm = measure_memory(name, args, fixed_mmap=False)
            line += f" {1 + dm['peak_extra'] / dm['logits']:>21.2f}x" if "error" not in dm else f" {'failed':>22}"
        if mem["grad"]:
            g = mem["grad"] / mem["logits"]
            line += f"  incl. the {g:.2f}x gradient itself; beyond it {extra - g:.2f}x"
        print(line)
    print(f"   speed-up fused vs naive: no grad {times['naive'] / times['fused']:.2f}x, "
          f"fwd+bwd {times['naive_grad'] / times['fused_grad']:.2f}x")
    print(f"   memory: {mem.get('how', '?')}, one fresh subprocess per variant, first call after a tiny warm-up;")
    if cpu:
        print("   MALLOC_MMAP_THRESHOLD_=65536 in the subprocess so the peak counts live tensors; the last")
        print("   column is the same with glibc's default (dynamic) threshold, which keeps freed buffers resident.")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="issue sizes: B=256 x T=4096, [4096, 32768] logits, 1024 model tokens")
    p.add_argument("--batch", type=int, default=64, help="responses B (part 1)")
    p.add_argument("--seq", type=int, default=1024, help="positions T per response (part 1)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument("--model-tokens", type=int, default=256, help="tokens the 135M model is actually timed on")
    p.add_argument("--model-seq", type=int, default=256, help="sequence length of the model measurement")
    p.add_argument("--model-repeats", type=int, default=1)
    p.add_argument("--skip-model", action="store_true", help="no model timing (no %% column)")
    p.add_argument("--rows", type=int, default=1024, help="N rows of logits (part 2)")
    p.add_argument("--vocab", type=int, default=32768, help="V (part 2)")
    p.add_argument("--only", choices=("1", "2"), help="run one part")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child_measure(args)
        return
    if args.full:
        args.batch, args.seq, args.rows, args.model_tokens, args.model_seq = 256, 4096, 4096, 1024, 512
    if args.batch % args.group_size:
        p.error(f"--batch ({args.batch}) must be a multiple of --group-size ({args.group_size})")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in (None, "1"):
        part1(args)
    if args.only in (None, "2"):
        part2(args)


if __name__ == "__main__":
    main()

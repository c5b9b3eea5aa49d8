"""The rollout copy's decode attention: torch's sdpa kernel against ``grouped_decode_attention``. (A script, not a test.)

``HFRollout(dtype=...).generate`` of the embedded SmolLM2-135M on the mul1 task (the README job's
rollout settings: temperature 0.7, 32 new tokens, ``max_batch_size`` 64), in three shapes:

* ``train``: 4 prompts x 4 samples (a README training step's rollout, 16 rows);
* ``greedy``: the 32 eval prompts, greedy (the eval's first call);
* ``eval-k``: the 32 eval prompts x 4 samples (the eval's mean@4 call: two calls of 64 rows).

The copy's attention implementation is switched between transformers' ``sdpa`` (what it decoded with
before 2026-12-07) and :data:`tokencredit.engine.attention.GROUPED` before each call; the two
alternate within one process, ``--reps`` times each with the same seeds, so that the machine's drift
falls on both; a warm-up call each first. The ratio is of the medians (grouped / sdpa). The tokens
can differ between the two (bf16 rounding of the attention moves a sampled token now and then);
each line gives the mean response length of both.

    python benchmarks/decode_attention.py                    # bf16 copy (what --precision bf16 / auto uses)
    python benchmarks/decode_attention.py --dtype fp32       # an fp32 copy (the fp32 trainer generates with its model, sdpa)
"""

from __future__ import annotations

import argparse
import statistics
import time

from update_buckets import cpu_name

SHAPES = {"train": (4, 4, 0.7, "train"), "greedy": (32, 1, 0.0, "eval"), "eval-k": (32, 4, 0.7, "eval")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shapes", default="train,greedy,eval-k", help=f"comma-separated, of {list(SHAPES)}")
    args = p.parse_args(argv)

    import torch

    from tokencredit.data.tasks import make_task
    from tokencredit.engine.attention import GROUPED
    from tokencredit.engine.forward import base_model
    from tokencredit.engine.models import EMBEDDED, resolve_model
    from tokencredit.engine.rollout import HFRollout

    torch.set_num_threads(args.threads)
    model, tok = resolve_model(EMBEDDED)
    task = make_task("mul1", seed=0, n_eval=32)
    ro = HFRollout(model, tok, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32, max_batch_size=64)
    gen = base_model(ro.generation_model())
    impls = ["sdpa", GROUPED]
    print(f"cpu {cpu_name()}; torch {torch.__version__}; threads {args.threads}; copy dtype {args.dtype}")
    for shape in args.shapes.split(","):
        n_prompts, k, temperature, split = SHAPES[shape]
        prompts = [list(e.messages) for e in getattr(task, split)[:n_prompts]]
        walls = {i: [] for i in impls}
        lengths = {i: [] for i in impls}
        for rep in range(args.reps + 1):  # rep 0: warm-up
            for impl in impls:
                gen.set_attn_implementation(impl)
                t = time.perf_counter()
                rb = ro.generate(prompts, num_samples=k, max_new_tokens=32, temperature=temperature, seed=rep)
                wall = time.perf_counter() - t
                if rep:
                    walls[impl].append(wall)
                    lengths[impl].append(float(rb.response_mask.sum(1).float().mean()))
        med = {i: statistics.median(w) for i, w in walls.items()}
        for impl in impls:
            print(f"{shape} ({n_prompts * k} rows): {impl} {', '.join(f'{w:.2f}' for w in walls[impl])} s, median "
                  f"{med[impl]:.2f} s, mean response length {statistics.mean(lengths[impl]):.1f}")
        print(f"ratio grouped/sdpa {shape} {med[GROUPED] / med['sdpa']:.2f}")


if __name__ == "__main__":
    main()

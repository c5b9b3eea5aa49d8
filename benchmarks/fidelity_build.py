"""How much faster is the fidelity build's shared-prefix sampling than plain ``generate``? (A script, not a test.)

``tokencredit fidelity build`` samples ``M`` continuations from every prefix of a saved batch.
Its sampler (:func:`tokencredit.analysis.fidelity.sample_continuations`) runs each prefix once and
indexes its KV cache out to the M rows (``share=True``); the baseline lets ``generate`` prefill
all ``prefixes x M`` rows itself (``share=False``). Both run here, in the same process, on the
same prefixes with the same seed (so they generate the same tokens, which is checked), at
several response positions of the bundled reference batch: early positions have short prefixes
and long continuations (decode dominates), late ones long prefixes and short continuations
(prefill dominates, where sharing should matter most).

The model is the embedded SmolLM2-135M-Instruct (``--model``; its base weights: the policy's
identity does not change the cost) on the bundled set's prompts and responses (``chain``,
48-token budget). Reported per position: continuation tokens, seconds and tokens/s of each
variant, and the ratio shared / plain, best of ``--repeats``.

    python benchmarks/fidelity_build.py                       # minutes on 2 CPU cores
    python benchmarks/fidelity_build.py --positions 0,8,16,24 --prefixes 8 -M 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--positions", default="0,8,16,24", help="response positions t of the prefixes")
    p.add_argument("--prefixes", type=int, default=8, help="prefixes per generate call (responses of the batch)")
    p.add_argument("-M", type=int, default=16, help="continuations per prefix")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from tokencredit.analysis.fidelity import (
        REFERENCE_SET,
        prompt_rows,
        load_estimates,
        response_rows,
        sample_continuations,
    )
    from tokencredit.engine.models import EMBEDDED, resolve_model

    est = load_estimates(REFERENCE_SET)
    saved = est["rollouts"]
    budget = int(est["settings"]["max_new_tokens"])
    model, tok = resolve_model(a.model or EMBEDDED)
    model.to(a.device)
    prompts, rows = prompt_rows(saved, tok), response_rows(saved)
    results = []
    for t in [int(x) for x in a.positions.split(",")]:
        bs = [b for b in range(len(rows)) if len(rows[b]) > t][: a.prefixes]
        prefixes = [prompts[b] + rows[b][:t] for b in bs]
        budgets = [budget - t] * len(bs)
        best = {}
        toks = {}
        for share in (True, False):
            for _ in range(a.repeats):
                torch.manual_seed(0)
                t0 = time.perf_counter()
                conts, n = sample_continuations(model, tok, prefixes, a.M, budgets, temperature=float(est["settings"]["temperature"]),
                                                share=share)
                if a.device.startswith("cuda"):
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                best[share] = min(best.get(share, float("inf")), dt)
                toks[share] = (n, conts)
        same = toks[True][1] == toks[False][1]
        n = toks[True][0]
        r = {"position": t, "prefixes": len(bs), "M": a.M, "prefix_tokens_mean": sum(map(len, prefixes)) / len(bs),
             "cont_tokens": n, "same_tokens": same,
             "shared_s": best[True], "plain_s": best[False],
             "shared_tok_s": n / best[True], "plain_tok_s": toks[False][0] / best[False],
             "speedup": best[False] / best[True]}
        results.append(r)
        if not a.json:
            print(f"t={t:3d}  prefix {r['prefix_tokens_mean']:5.1f} tok  {n:5d} continuation tokens  shared {r['shared_tok_s']:7.1f} tok/s  "
                  f"plain {r['plain_tok_s']:7.1f} tok/s  speedup {r['speedup']:.2f}x  same tokens: {same}", flush=True)
    tot_n = sum(r["cont_tokens"] for r in results)
    summary = {"device": a.device, "threads": a.threads, "shared_tok_s": tot_n / sum(r["shared_s"] for r in results),
               "plain_tok_s": tot_n / sum(r["plain_s"] for r in results)}
    summary["speedup"] = summary["shared_tok_s"] / summary["plain_tok_s"]
    if a.json:
        print(json.dumps({"positions": results, "all": summary}, indent=1))
    else:
        print(f"all positions: shared {summary['shared_tok_s']:.1f} tok/s, plain {summary['plain_tok_s']:.1f} tok/s, "
              f"speedup {summary['speedup']:.2f}x ({a.device}, {a.threads} thread(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

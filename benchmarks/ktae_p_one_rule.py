"""How much KTAE's two p = 1 rules differ (docs/methods.md, ktae): the reference's float32 test
(``p_one_rule="float32"``) against the exact rule, on Zipf-like groups of 8 responses x 300
tokens (token ids drawn with probability ~ 1 / rank^s over a vocabulary of V ids, rewards 0/1 with
both outcomes in each group).

    .venv/bin/python benchmarks/ktae_p_one_rule.py [--groups 50] [--s 1.1] [--vocab 5000]
"""

from __future__ import annotations

import argparse

import torch

from tokencredit import CreditBatch
from tokencredit.credit.methods.ktae import KTAEConfig, ktae


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=50)
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=5000)
    ap.add_argument("--s", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(a.seed)
    zipf = 1.0 / torch.arange(1, a.vocab + 1, dtype=torch.float64) ** a.s
    B = a.groups * a.size
    ids = torch.multinomial(zipf / zipf.sum(), B * a.tokens, replacement=True, generator=gen).view(B, a.tokens)
    R = torch.randint(0, 2, (B,), generator=gen).double()
    R[:: a.size], R[1 :: a.size] = 1.0, 0.0  # both outcomes in every group
    batch = CreditBatch(response_mask=torch.ones(B, a.tokens, dtype=torch.bool), rewards=R,
                        group_ids=torch.arange(B) // a.size, token_ids=ids)
    ref = ktae(batch, KTAEConfig(p_one_rule="float32")).advantages.double()
    exact = ktae(batch, KTAEConfig(p_one_rule="exact")).advantages.double()
    d = (ref - exact).abs()
    print(f"{a.groups} groups of {a.size} x {a.tokens} tokens, Zipf s={a.s}, V={a.vocab}")
    print(f"tokens differing (> 1e-6): {float((d > 1e-6).double().mean()):.3f}")
    print(f"tokens differing by > 0.05: {float((d > 0.05).double().mean()):.3f}")
    print(f"max |difference|: {float(d.max()):.4f}   mean |difference|: {float(d.mean()):.4f}")


if __name__ == "__main__":
    main()

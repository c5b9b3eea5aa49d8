"""Files a verl end-to-end run reads: a tiny random Llama saved as a ``from_pretrained`` folder
(its LM head scaled so that next-token entropies vary along a response, as a trained model's do),
and train/val parquet files in verl's data layout (chat ``prompt``, ``reward_model.ground_truth``)."""

from __future__ import annotations

import os

import torch

#: LM-head scale: a random tiny Llama is nearly uniform over its 99 tokens; x30 gives per-token
#: entropies of about 1-3 nats that vary along a response, so entropy-reading methods act
HEAD_SCALE = 30.0


def write_model(folder: str, seed: int = 0) -> str:
    from tokencredit.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_data(folder: str, n_train: int = 16, n_val: int = 4, seed: int = 0) -> str:
    import random

    import pandas as pd

    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)

    def rows(n, split):
        out = []
        for i in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            answer = str(a * b)
            out.append({
                "data_source": "tokencredit/mul",
                "prompt": [{"role": "user", "content": f"{a}*{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer + "xyz"},
                "extra_info": {"split": split, "index": i, "question": f"{a}*{b}=", "answer": answer},
            })
        return out

    pd.DataFrame(rows(n_train, "train")).to_parquet(os.path.join(folder, "train.parquet"))
    pd.DataFrame(rows(n_val, "test")).to_parquet(os.path.join(folder, "test.parquet"))
    return folder


if __name__ == "__main__":
    import sys

    root = sys.argv[1]
    write_model(os.path.join(root, "model"))
    write_data(os.path.join(root, "data"))
    print(root)

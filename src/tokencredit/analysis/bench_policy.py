"""The policies ``tokencredit bench`` trains: a small Llama built in code from a seed, restricted
to its task's response alphabet, warm-started in a few seconds on noisy demonstrations.

    model, tok = bench_policy("carry", seed=3)            # the same seed: the same weights

* The tokenizer is :func:`tokencredit.testing.tiny_tokenizer` (one token per printable ASCII
  character, ChatML template). The model is a 2-layer ``LlamaForCausalLM`` (hidden 64) whose LM
  head carries a frozen bias: 0 on the task's alphabet, -1e4 on every other token, so the policy
  puts probability exactly 0 (float32 and float64 underflow) outside the alphabet and never
  emits the end token: its responses are exactly ``max_new_tokens`` long, and the exact values
  of :mod:`tokencredit.engine.exactvalue` are those of the distribution it samples from.
* The warm start (:func:`warm_start`) is supervised: ``WARM_STEPS`` AdamW steps of cross-entropy
  on the task's noisy demonstrations (:func:`tokencredit.data.controlled.demonstration`), drawn from
  the seed. No task is warm-started at present: the near-uniform initial policy already
  succeeds 1/8 (keytok), 1/8 (carry) and 1/3 (fork) of the time.

The result of a (task, seed) is cached as a ``weights_only`` state dict (:func:`cached_policy`)
so that every spec of a seed starts from the same weights (paired seeds) without repeating it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional, Tuple

import torch

__all__ = ["bench_policy", "warm_start", "cached_policy", "WARM_STEPS", "MASK_BIAS"]

MASK_BIAS = -1e4
WARM_STEPS = {"keytok": 0, "carry": 0, "fork": 0}
WARM_LR = 1e-2
WARM_BATCH = 64


def _model(tokenizer, allowed, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        old = model.lm_head
        head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.fill_(MASK_BIAS)
            head.bias[torch.tensor(list(allowed))] = 0.0
        head.bias.requires_grad_(False)
        model.lm_head = head
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, k, getattr(tokenizer, k))
    model.eval()
    return model


def bench_policy(task: str, seed: int, *, warm: bool = True):
    """``(model, tokenizer)``: the task's policy of ``seed``, warm-started unless ``warm=False``."""
    from ..data.controlled import CONTROLLED
    from ..engine.exactvalue import alphabet_ids
    from ..testing import tiny_tokenizer

    if task not in CONTROLLED:
        raise ValueError(f"task: expected one of {sorted(CONTROLLED)}, got {task!r}")
    tok = tiny_tokenizer()
    model = _model(tok, alphabet_ids(tok, CONTROLLED[task].space), seed)
    if warm:
        warm_start(model, tok, task, seed)
    return model, tok


def warm_start(model, tokenizer, task: str, seed: int, steps: Optional[int] = None) -> None:
    """Cross-entropy on noisy demonstrations of the task's questions (in place, global RNG untouched)."""
    from ..data.controlled import CONTROLLED, build, demonstration

    steps = WARM_STEPS[task] if steps is None else steps
    if steps <= 0:
        return
    examples, _ = build(task, seed, 10**6, 0)
    rng = random.Random(f"warm-{task}-{seed}")
    prompts = [tokenizer.apply_chat_template(list(e.messages), tokenize=False, add_generation_prompt=True) for e in examples]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=WARM_LR, weight_decay=0.0)
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            pick = [rng.randrange(len(examples)) for _ in range(WARM_BATCH)]
            texts = [prompts[i] + demonstration(task, examples[i], rng) for i in pick]
            n_resp = CONTROLLED[task].space.length
            enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            pred = logits[:, -n_resp - 1:-1]
            loss = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), enc["input_ids"][:, -n_resp:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()


def cached_policy(task: str, seed: int, cache_dir: Optional[Path]) -> Tuple[torch.nn.Module, object]:
    """:func:`bench_policy`, its trainable weights cached under ``cache_dir`` (``<task>_seed<k>.pt``,
    written atomically, read with ``weights_only=True``); None: no cache."""
    if cache_dir is None:
        return bench_policy(task, seed)
    path = Path(cache_dir) / f"{task}_seed{seed}.pt"
    if path.exists():
        model, tok = bench_policy(task, seed, warm=False)
        state = torch.load(path, weights_only=True, map_location="cpu")
        model.load_state_dict(state, strict=True)
        return model, tok
    model, tok = bench_policy(task, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{random.getrandbits(32)}")
    torch.save(model.state_dict(), tmp)
    tmp.replace(path)
    return model, tok

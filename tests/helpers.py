"""Shared test helpers: build valid CreditBatches with every signal, deterministically."""

from __future__ import annotations

import math

import torch

from tokencredit import CreditBatch


def random_distributions(B: int, T: int, V: int, gen: torch.Generator, temperature: float = 1.0):
    """Random next-token logits and a sampled token per position (for consistent signals)."""
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2.0
    probs = torch.softmax(logits / temperature, -1)
    tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=gen).reshape(B, T)
    return logits, probs, tokens


def make_batch(
    B: int = 8,
    T: int = 6,
    group_size: int = 4,
    *,
    seed: int = 0,
    V: int = 11,
    lengths=None,
    binary_rewards: bool = True,
    dtype=torch.float32,
    signals=("logprobs", "old_logprobs", "ref_logprobs", "entropy", "mode_prob", "hidden_residual", "oracle_logprobs", "values",
             "token_ids", "planning_mask", "true_values", "sum_pi_squared", "mc_values", "step_starts",
             "outcome_saliency"),
) -> CreditBatch:
    """A valid batch whose token signals are mutually consistent (taken from real distributions).

    Rewards are in {0, 1} (or uniform in [0, 1]); each group gets at least one of each reward
    value when binary so that group-normalised advantages are non-zero.
    """
    assert B % group_size == 0
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
    else:
        lengths = torch.as_tensor(lengths)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)
    if binary_rewards:
        rewards = torch.randint(0, 2, (B,), generator=gen).to(dtype)
        # make every group mixed
        for g0 in range(0, B, group_size):
            rewards[g0] = 1.0
            rewards[g0 + 1] = 0.0
    else:
        rewards = torch.rand(B, generator=gen).to(dtype)
    group_ids = torch.arange(B) // group_size * 7 + 3  # non-contiguous ids on purpose
    kw = {}
    logits, probs, tokens = random_distributions(B, T, V, gen)
    logp = torch.log(probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
    if "logprobs" in signals:
        kw["logprobs"] = logp.to(dtype)
    if "old_logprobs" in signals:
        kw["old_logprobs"] = (logp + 0.05 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp_max(0).to(dtype)
    if "ref_logprobs" in signals:
        kw["ref_logprobs"] = (logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp_max(0).to(dtype)
    if "entropy" in signals:
        kw["entropy"] = (-(probs * probs.log()).sum(-1)).to(dtype)
    if "mode_prob" in signals:
        kw["mode_prob"] = probs.max(-1).values.to(dtype)
    if "hidden_residual" in signals:
        kw["hidden_residual"] = torch.rand(B, T, generator=gen, dtype=torch.float64).mul(3).to(dtype)
    if "oracle_logprobs" in signals:
        kw["oracle_logprobs"] = (logp + torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp_max(0).to(dtype)
    if "values" in signals:
        kw["values"] = torch.rand(B, T + 1, generator=gen, dtype=torch.float64).to(dtype)
    if "token_ids" in signals:
        kw["token_ids"] = tokens  # the sampled tokens the other signals are of
    if "planning_mask" in signals:
        kw["planning_mask"] = (torch.rand(B, T, generator=gen) < 0.3).long()
    if "sum_pi_squared" in signals:  # of the same distributions; no draw
        kw["sum_pi_squared"] = probs.square().sum(-1).to(dtype)
    if "true_values" in signals:  # its own stream: the draws above are as before it was added
        kw["true_values"] = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 7919), dtype=torch.float64).to(dtype)
    if "mc_values" in signals or "step_starts" in signals:  # steps of 2 tokens, each with its own MC value (own stream)
        g = torch.Generator().manual_seed(seed + 104729)
        step = torch.arange(T) // 2
        starts = (torch.arange(T) % 2 == 0).to(dtype).expand(B, T).clone()
        values = (torch.randint(0, 5, (B, (T + 1) // 2), generator=g).double() / 4).to(dtype)[:, step]
        kw.update({k: v for k, v in (("step_starts", starts), ("mc_values", values)) if k in signals})
    if "outcome_saliency" in signals:  # skewed magnitudes, as saliencies are (own stream)
        g = torch.Generator().manual_seed(seed + 15485863)
        kw["outcome_saliency"] = torch.rand(B, T, generator=g, dtype=torch.float64).pow(3).mul(2).to(dtype)
    return CreditBatch(response_mask=mask, rewards=rewards, group_ids=group_ids, **kw)


def pad_batch(batch: CreditBatch, extra: int, fill: float = float("nan")) -> CreditBatch:
    """Append ``extra`` padding positions (mask 0, signals = ``fill``) to every response."""
    def pad(x, width):
        if x is None:
            return None
        p = torch.full((x.shape[0], width), fill if x.is_floating_point() else 0, dtype=x.dtype)
        return torch.cat([x, p], dim=1)

    d = batch.to_dict()
    for k, v in list(d.items()):
        if k in ("rewards", "group_ids") or v is None:
            continue
        d[k] = pad(v, extra)
    d["response_mask"] = pad(batch.response_mask, extra)
    return CreditBatch(**d)


def log_v_minus_1(V: int) -> float:
    return math.log(V - 1)


class InterruptingBench:
    """A ``trainer_factory`` for ``bench.run_bench``: ``bench.make_trainer``, but the run of
    ``credit`` raises Ctrl-C in its ``at``-th step (the trainer checkpoints the steps before and
    stops); ``once``: only the first such run."""

    def __init__(self, init_dir, credit: str, *, at: int = 4, once: bool = False):
        self.init_dir, self.credit, self.at, self.once, self.done = init_dir, credit, at, once, False

    def __call__(self, cfg):
        from tokencredit.analysis import bench

        tr = bench.make_trainer(cfg, init_dir=self.init_dir, keep=bench.kept_steps(cfg.task.name, quick=True))
        if cfg.credit == self.credit and not (self.once and self.done):
            self.done = True
            real, calls = tr.train_step, {"n": 0}

            def step():
                calls["n"] += 1
                if calls["n"] == self.at:
                    raise KeyboardInterrupt
                return real()

            tr.train_step = step
        return tr

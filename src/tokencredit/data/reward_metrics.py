"""TRL's logged metric names for a step's rewards and completions (the own trainer logs them;
:mod:`tokencredit.data.rewards` computes the rewards)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["completion_metrics", "reward_metrics"]


def _nanmean_std(xs: Sequence[float]) -> Tuple[float, float]:
    vals = [x for x in xs if not math.isnan(x)]
    if not vals:
        return math.nan, math.nan
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((x - m) ** 2 for x in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return m, sd


def reward_metrics(batches: Sequence[Any], group_ids: Sequence[Sequence[int]], prefix: str = "") -> Dict[str, float]:
    """TRL's reward metrics over a step's batches: ``rewards/NAME/mean`` and ``/std`` (over the
    completions each function scored), ``reward`` and ``reward_std`` (the weighted sum),
    ``frac_reward_zero_std`` (the share of groups whose rewards are all equal), plus
    ``rewards/NAME/failed`` (completions whose score failed)."""
    if not batches:
        return {}
    out: Dict[str, float] = {}
    for fi, name in enumerate(batches[0].names):
        m, sd = _nanmean_std([v for b in batches for v in b.values[fi]])
        out[f"{prefix}rewards/{name}/mean"] = m
        out[f"{prefix}rewards/{name}/std"] = sd
        out[f"{prefix}rewards/{name}/failed"] = float(sum(b.failed_per_func[fi] for b in batches))
    total = [v for b in batches for v in b.total]
    out[f"{prefix}reward"], out[f"{prefix}reward_std"] = _nanmean_std(total)
    zero, groups = 0, 0
    for b, gids in zip(batches, group_ids):
        by: Dict[int, List[float]] = {}
        for g, v in zip(gids, b.total):
            by.setdefault(int(g), []).append(v)
        for vals in by.values():
            groups += 1
            zero += int(max(vals) - min(vals) <= 1e-8 * max(1.0, abs(max(vals))))
    if groups:
        out[f"{prefix}frac_reward_zero_std"] = zero / groups
    for b in batches:
        out.update({prefix + k: v for k, v in b.extra.items()})
    # a function that scored nothing has no mean: left out (metrics.jsonl holds JSON numbers only)
    return {k: v for k, v in out.items() if not math.isnan(v)}


def completion_metrics(lengths: Sequence[int], clipped: Sequence[bool]) -> Dict[str, float]:
    """TRL's completion metrics: ``completions/mean_length``, ``min_length``, ``max_length``,
    ``clipped_ratio`` (the share that hit the generation budget without an EOS) and the same
    lengths over the terminated ones."""
    lengths = [int(x) for x in lengths]
    if not lengths:
        return {}
    term = [n for n, c in zip(lengths, clipped) if not c] or [0]
    return {
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/clipped_ratio": sum(bool(c) for c in clipped) / len(lengths),
        "completions/mean_terminated_length": sum(term) / len(term),
        "completions/min_terminated_length": float(min(term)),
        "completions/max_terminated_length": float(max(term)),
    }

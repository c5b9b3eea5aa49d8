"""Common random numbers for the Monte Carlo continuations of neighbouring prefixes.

The true credit ``c_t = V(h_{t+1}) - V(h_t)`` is a difference of two estimates. Sampled
independently, their noises add; sampled with the same random numbers, most of it cancels.
Here a continuation draws each token by the Gumbel-max trick,

    y = argmax_v ( logit_v / temperature + G_v ),   G_v ~ Gumbel(0, 1) i.i.d.

which is an exact sample of the temperature-scaled softmax (of its top-p nucleus when
``top_p < 1``: the other logits are set to -inf first), and the noise ``G`` of continuation
``m`` at response position ``p`` of row ``b`` is a fixed function of ``(seed, b, m, p)``
(:func:`gumbel_noise`). The continuations of ``h_t`` and ``h_{t+1}`` with the same index ``m``
therefore share their noise at every position: when the one from ``h_t`` happens to draw the
response's own token ``y_t``, it continues exactly as the one from ``h_{t+1}`` (same prefix,
same noise), and both score the same reward. Each estimate is still an unbiased mean of ``M``
independent continuations (the indices ``m`` are independent), so the split-half reference
(even against odd ``m``) stays a valid noise reference.

:func:`CRNProcessor` applies this inside ``transformers``' ``generate`` (greedy decoding of the
perturbed logits); :func:`gumbel_choice` is the same draw for any vector of logits (the tests'
tabular policy).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

__all__ = ["noise_seed", "gumbel_noise", "gumbel_choice", "CRNProcessor"]

_MASK = (1 << 63) - 1


def noise_seed(seed: int, row: int, m: int, pos: int) -> int:
    """A generator seed that is a fixed function of (seed, row, continuation index, response position)."""
    h = int(seed) & _MASK
    for x in (row, m, pos):
        h = (h * 1_000_003 + int(x) + 0x9E3779B97F4A7C15) & _MASK
    return h


def gumbel_noise(keys: Sequence[Tuple[int, int, int]], V: int, *, seed: int, device=None) -> torch.Tensor:
    """``[len(keys), V]`` float64 Gumbel(0, 1) noise, row i a fixed function of ``(seed, *keys[i])``."""
    out = torch.empty((len(keys), V), dtype=torch.float64)
    g = torch.Generator()
    tiny = torch.finfo(torch.float64).tiny
    for i, (row, m, pos) in enumerate(keys):
        g.manual_seed(noise_seed(seed, row, m, pos))
        u = torch.rand(V, generator=g, dtype=torch.float64).clamp(tiny, 1.0 - 1e-16)
        out[i] = -torch.log(-torch.log(u))
    return out if device is None else out.to(device)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    probs = torch.softmax(logits, -1)
    srt, idx = probs.sort(-1, descending=True)
    before = srt.cumsum(-1) - srt  # mass strictly above each token
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, idx, before >= top_p)
    return logits.masked_fill(drop, float("-inf"))


def gumbel_choice(logits: torch.Tensor, keys: Sequence[Tuple[int, int, int]], *, seed: int, temperature: float = 1.0,
                  top_p: float = 1.0) -> torch.Tensor:
    """The Gumbel-max draw of each row of ``logits [N, V]`` with the noise of ``keys[i]``."""
    z = _nucleus(logits.double() / float(temperature), top_p)
    return (z + gumbel_noise(keys, logits.shape[-1], seed=seed, device=logits.device)).argmax(-1)


class CRNProcessor:
    """A ``transformers`` logits processor for greedy ``generate``: the scores of row ``r``
    become ``logits / temperature`` (top-p filtered) plus the noise of ``(row_b, m, t0 + k)``,
    ``k`` the number of tokens generated so far, so that argmax is the Gumbel-max sample.

    ``rows``: per generated row, ``(b, m, t0)``: the response it continues, the continuation
    index and the response position of its first new token. ``input_len``: the prompt length of
    the ``generate`` call (left-padded)."""

    def __init__(self, rows: Sequence[Tuple[int, int, int]], input_len: int, *, seed: int, temperature: float,
                 top_p: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature: common random numbers need sampling (> 0), got {temperature}")
        self.rows = list(rows)
        self.input_len = int(input_len)
        self.seed = int(seed)
        self.temperature = float(temperature)
        self.top_p = float(top_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        k = int(input_ids.shape[1]) - self.input_len
        keys = [(b, m, t0 + k) for b, m, t0 in self.rows]
        z = _nucleus(scores.double() / self.temperature, self.top_p)
        return (z + gumbel_noise(keys, scores.shape[-1], seed=self.seed, device=scores.device)).to(scores.dtype)


def crn_rows(keys: Sequence[Tuple[int, int]], M: int) -> list:
    """The ``(b, m, t0)`` of every generated row for prefixes ``keys = [(b, t), ...]``, M rows each."""
    return [(b, m, t) for b, t in keys for m in range(M)]


def check_keys(keys: Optional[Sequence[Tuple[int, int]]], n: int) -> None:
    if keys is not None and len(keys) != n:
        raise ValueError(f"crn keys: expected one (row, position) per prefix ({n}), got {len(keys)}")

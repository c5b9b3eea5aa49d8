"""Planning tokens: strategic-gram matches in a decoded response (the ``planning_mask`` signal
that HICRA and SEPA read).

A window of up to ``max(5, longest gram in words)`` cleaned token fragments, joined by spaces,
is searched (case-insensitive, word boundaries) for any gram of :data:`DEFAULT_STRATEGIC_GRAMS`
("wait let me", "let me check", "the key is", ...); from each start position the first window
that matches marks its tokens. Provenance: the ``teilomillet/retrain`` project's detector
(``retrain/advantages/planning.py``, ``retrain/planning/regex.py``; the gram list from
``retrain/config/schema.py``).

The tokens are the response's tokens decoded one at a time (``tokenizer.decode([id])``), as the
trainers compute the signal (:func:`planning_mask`) and as every rollouts file stores them
(``tokens``), from which ``inspect`` and ``fidelity`` derive it.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable, List, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["DEFAULT_STRATEGIC_GRAMS", "planning_mask_of", "planning_mask"]

#: the strategic grams of retrain's default detector (retrain/advantages/planning.py)
DEFAULT_STRATEGIC_GRAMS: Tuple[str, ...] = (
    "wait let me", "let me think", "on second thought", "let me check", "let me verify",
    "is this right", "double check", "try another approach", "go back and", "start over",
    "that's not right", "that doesn't work", "another way to", "or we could", "what if we",
    "notice that", "the key is", "the key insight",
)


def _clean(fragment: str) -> str:
    # sentencepiece and byte-level BPE word markers count as spaces
    return fragment.replace("\u2581", " ").replace("\u0120", " ").strip()


@lru_cache(maxsize=16)
def _pattern(grams: Tuple[str, ...]):
    return re.compile("|".join(rf"\b{re.escape(g)}\b" for g in grams), re.IGNORECASE)


def planning_mask_of(tokens: Sequence[str], grams: Sequence[str] = DEFAULT_STRATEGIC_GRAMS, max_window: int = 5) -> List[int]:
    """1 for the tokens of a strategic-gram match, 0 elsewhere (one response's token strings)."""
    n = len(tokens)
    grams = tuple(grams)
    if n == 0 or not grams:
        return [0] * n
    width = max(max_window, max(len(g.split()) for g in grams))
    pat = _pattern(grams)
    words = [_clean(t) for t in tokens]
    out = [0] * n
    for start in range(n):
        text = ""
        for end in range(start, min(start + width, n)):
            if words[end]:
                text = f"{text} {words[end]}" if text else words[end]
            if pat.search(text):
                out[start:end + 1] = [1] * (end + 1 - start)
                break
    return out


def planning_mask(response_ids: Tensor, response_mask: Tensor, decode: Callable[[List[int]], str],
                  grams: Sequence[str] = DEFAULT_STRATEGIC_GRAMS) -> Tensor:
    """``[B, T]`` 0/1 (long): :func:`planning_mask_of` of each row's valid tokens, each decoded
    alone with ``decode`` (a tokenizer's ``decode``); 0 on padding."""
    mask = response_mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.long, device=response_ids.device)
    for b in range(mask.shape[0]):
        pos = mask[b].nonzero().squeeze(1)
        if pos.numel():
            tokens = [decode([int(t)]) for t in response_ids[b, pos].tolist()]
            out[b, pos] = torch.tensor(planning_mask_of(tokens, grams), dtype=torch.long, device=out.device)
    return out

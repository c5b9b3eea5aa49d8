"""The estimates file's format and the batch it is of: shared by :mod:`tokencredit.fidelity`
(Monte Carlo estimates, scores) and :mod:`tokencredit.fidelity_exact` (the exact tier), so that
neither imports the other's machinery (no import cycle)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List

import torch

__all__ = ["FORMAT", "FidelityError", "batch_fingerprint", "response_rows"]

FORMAT = "tokencredit-fidelity/1"


class FidelityError(ValueError):
    """Bad input to the fidelity instrument; the message is one line naming what does not match."""


def _lengths(saved: Dict[str, Any]) -> List[int]:
    return [int(x) for x in torch.as_tensor(saved["signals"]["response_mask"]).bool().sum(1)]


def response_rows(saved: Dict[str, Any]) -> List[List[int]]:
    """The response token ids of every row, without padding."""
    ids = saved.get("response_ids")
    if ids is None:
        raise FidelityError("ROLLOUTS: no 'response_ids' (saved by the trainer's _save_rollouts); cannot continue its prefixes")
    ids = torch.as_tensor(ids)
    return [ids[i, :n].tolist() for i, n in enumerate(_lengths(saved))]


def batch_fingerprint(saved: Dict[str, Any]) -> str:
    """sha1 of the questions, response tokens and rewards: which batch an estimates file is of."""
    h = hashlib.sha1()
    for q, row, r in zip(saved.get("questions") or [""] * len(_lengths(saved)), response_rows(saved),
                         torch.as_tensor(saved["signals"]["rewards"]).float().tolist()):
        h.update(json.dumps([str(q), row, round(float(r), 6)]).encode())
    return h.hexdigest()[:16]


def _atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)

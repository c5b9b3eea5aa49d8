"""What every part of the fidelity package shares: the estimates file's format tag, the error
type, the batch's response rows and fingerprint, the positions whose V is estimated, and where
the bundled sets are (``tokencredit/data``, shipped as package data)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from ...errors import EstimatesMismatch, FidelityError  # noqa: F401 (defined in errors; importable here too)

__all__ = ["FORMAT", "EstimatesMismatch", "FidelityError", "REFERENCE_EXACT", "REFERENCE_SET", "REFERENCE_SPANS_CRN", "REFERENCE_TOKENS", "REFERENCE_TOKENS_CRN",
           "atomic_save", "batch_fingerprint", "check_rows", "mc_positions", "response_lengths", "response_rows"]

FORMAT = "tokencredit-fidelity/1"

_DATA = Path(__file__).resolve().parents[2] / "data"  # tokencredit/data: the bundled sets
#: the bundled span set: V every 4th position of a 64-response batch (``scripts/build_fidelity_set.py``)
REFERENCE_SET = _DATA / "fidelity_reference.pt"
#: the same batch, V at every position (credit per token) for the first groups of responses
REFERENCE_TOKENS = _DATA / "fidelity_reference_tokens.pt"
#: the same batch and rows as REFERENCE_TOKENS, with common random numbers (``--crn``), for the groups
#: its build completed
REFERENCE_TOKENS_CRN = _DATA / "fidelity_reference_tokens_crn.pt"
#: the span set's batch, rows and settings with common random numbers (``--crn``), and its critics
REFERENCE_SPANS_CRN = _DATA / "fidelity_reference_crn.pt"
#: the bundled exact set (``tokencredit fidelity --reference exact``; docs/fidelity.md)
REFERENCE_EXACT = _DATA / "fidelity_exact_mul1.pt"
REFERENCE_EXACT_COMMAND = ("tokencredit fidelity build --task mul1 --exact -o " + str(REFERENCE_EXACT)
                           + " --prompts 32 --samples 4 --max-new-tokens 3 --temperature 1.0 --threads 1")


def response_lengths(saved: Dict[str, Any]) -> List[int]:
    """The number of response tokens of every row of a rollouts record (its response mask)."""
    return [int(x) for x in torch.as_tensor(saved["signals"]["response_mask"]).bool().sum(1)]


def response_rows(saved: Dict[str, Any]) -> List[List[int]]:
    """The response token ids of every row, without padding."""
    ids = saved.get("response_ids")
    if ids is None:
        raise FidelityError("ROLLOUTS: no 'response_ids' (saved by the trainer's save_rollouts); cannot continue its prefixes")
    ids = torch.as_tensor(ids)
    return [ids[i, :n].tolist() for i, n in enumerate(response_lengths(saved))]


def batch_fingerprint(saved: Dict[str, Any]) -> str:
    """sha1 of the questions, response tokens and rewards: which batch an estimates file is of."""
    h = hashlib.sha1()
    for q, row, r in zip(saved.get("questions") or [""] * len(response_lengths(saved)), response_rows(saved),
                         torch.as_tensor(saved["signals"]["rewards"]).float().tolist()):
        h.update(json.dumps([str(q), row, round(float(r), 6)]).encode())
    return h.hexdigest()[:16]


def atomic_save(obj: Any, path: Path) -> None:
    """``obj`` into ``path`` through a temporary sibling (fsynced, renamed): a kill leaves the old
    file or the new one. A failed write removes the temporary file; a full disk is one line
    (:class:`~tokencredit.train.runfolder.DiskFullError`, naming ``path``)."""
    from ...train.checkpoint import save_torch
    from ...train.runfolder import DiskFullError, is_disk_full

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_torch(obj, tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise DiskFullError(path, "fidelity estimates", e) from None
        raise


def mc_positions(length: int, stride: int) -> List[int]:
    """Positions whose V is estimated: 0, stride, 2*stride, ... below ``length``."""
    return list(range(0, max(int(length), 1), int(stride)))


def check_rows(rows: Optional[Sequence[int]], B: int) -> List[int]:
    """The responses to estimate: all, or ``rows`` if they are distinct indices of the batch."""
    chosen = list(range(B)) if rows is None else [int(b) for b in rows]
    if len(set(chosen)) != len(chosen) or any(not 0 <= b < B for b in chosen):
        raise FidelityError(f"rows: expected distinct response indices in 0..{B - 1}, got {list(rows)}")
    return chosen

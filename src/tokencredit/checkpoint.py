"""Atomic checkpoints: written to a temporary directory, then renamed into place.

A checkpoint holds everything a run needs to continue exactly: trainable weights (the adapter
only under LoRA), optimizer and scheduler, critic, RNG states, step, data position and the
credit method's state (STARE's controller). The last ``keep_last`` are kept.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state", "set_rng_state"]

_PATTERN = re.compile(r"^step_(\d{8})$")


def rng_state() -> Dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _checkpoints(root: Path):
    if not root.exists():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    cps = _checkpoints(Path(root))
    return cps[-1] if cps else None


def save_checkpoint(root: str | os.PathLike, step: int, state: Dict[str, Any], keep_last: int = 2) -> Path:
    """Write ``state`` as ``root/step_XXXXXXXX/state.pt`` atomically and prune old ones."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    path = tmp / "state.pt"
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # same step saved twice (e.g. Ctrl-C right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in _checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike) -> Dict[str, Any]:
    path = Path(path)
    f = path / "state.pt" if path.is_dir() else path
    if not f.exists():
        raise FileNotFoundError(f"checkpoint: no state.pt in {path}")
    # our own file: it holds RNG states and numpy arrays, so weights_only loading is not possible
    return torch.load(f, map_location="cpu", weights_only=False)

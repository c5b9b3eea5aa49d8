"""Atomic checkpoints: written to a temporary directory, then renamed into place.

A checkpoint holds everything a run needs to continue exactly: trainable weights (the adapter
only under LoRA), optimizer and scheduler, critic, RNG states, step, data position and the
credit method's state (STARE's controller). The last ``keep_last`` are kept.

Every value is a tensor or a plain Python value (dict, list, tuple, str, int, float, bool,
None), so a checkpoint is read with ``torch.load(weights_only=True)``: loading a file can never
run code. A file that needs more (a crafted pickle, or one not written by tokencredit) is
refused with a :class:`CheckpointError` that names it. A damaged newest checkpoint (a truncated
file) is skipped with a warning by :func:`load_latest_checkpoint`, which falls back to the newest
intact one; the ``.tmp_step_*`` folders a kill during a save leaves behind are removed at the
next save, and a save that fails (a full disk) removes its own at once and says so in one line.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "check_output_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "load_latest_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

_PATTERN = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp_step_"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file. ``unsafe`` is True when the
    file was refused because loading it would need more than tensors and plain values."""

    def __init__(self, message: str, *, unsafe: bool = False):
        super().__init__(message)
        self.unsafe = unsafe


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped (the message names it and the one used instead)."""


# -- RNG states as tensors and plain values ------------------------------------------------


def rng_state() -> Dict[str, Any]:
    """Python's, numpy's, torch's (and CUDA's) RNG states as tensors and plain values."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": int(version), "state": torch.tensor(mt, dtype=torch.int64),
                   "gauss_next": None if gauss is None else float(gauss)},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: Dict[str, Any]) -> None:
    p, n = state["python"], state["numpy"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss_next"]))
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- files ------------------------------------------------------------------------------------


def _checkpoints(root: Path):
    if not root.exists():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    cps = _checkpoints(Path(root))
    return cps[-1] if cps else None


def check_output_dir(path: str | os.PathLike, field: str = "output_dir") -> None:
    """Raise ``ConfigError`` unless ``path`` is (or can be created as) a writable directory.
    Creates nothing: the nearest existing ancestor must be a writable directory."""
    from .config import ConfigError

    p = Path(path)
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = "is a file" if probe == p else f"is under {str(probe)!r}, which is a file"
        raise ConfigError(f"{field}: expected a directory, got {str(p)!r}, which {what}")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: expected a writable directory, got {str(p)!r} ({str(probe)!r} is not writable)")


class _CheckpointFile:
    """The file ``torch.save`` writes a checkpoint into. torch turns an exception raised in the
    file's ``write`` into a RuntimeError of its own; the exception itself (an OSError of a full
    disk, the KeyboardInterrupt of a Ctrl-C or SIGTERM handled there) is kept here."""

    def __init__(self, f):
        self.f = f
        self.error: Optional[BaseException] = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except BaseException as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(root: str | os.PathLike, step: int, state: Dict[str, Any], keep_last: int = 2) -> Path:
    """Write ``state`` as ``root/step_XXXXXXXX/state.pt`` atomically and prune old ones.

    Temporary folders left by a save that was killed (``.tmp_step_*``) are removed first. A
    save that fails (a full disk: :class:`~tokencredit.runfolder.DiskFullError`, one line)
    removes its temporary folder and leaves every earlier checkpoint as it was."""
    from .runfolder import DiskFullError, is_disk_full, process_tag, stale_temporaries

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in stale_temporaries(root, _TMP_PREFIX):  # never a live process's (runfolder)
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"{_TMP_PREFIX}{step:08d}_{process_tag()}"
    try:
        tmp.mkdir()
        with open(tmp / "state.pt", "wb") as f:
            out = _CheckpointFile(f)
            try:
                torch.save(state, out)
            except RuntimeError as e:
                if out.error is not None:  # the file's own exception, not torch's wrapping of it
                    raise out.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
    except (Exception, KeyboardInterrupt) as e:  # a full disk, torch's error, Ctrl-C / SIGTERM: no temporary folder left
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):  # the caller says which checkpoint is left (the temporary one is gone)
            raise DiskFullError(tmp / "state.pt", f"checkpoint of step {step} (not written)", e) from None
        raise
    if final.exists():  # same step saved twice (e.g. Ctrl-C right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in _checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike) -> Dict[str, Any]:
    """Read a checkpoint folder (or its ``state.pt``) with ``weights_only=True``.

    Raises :class:`CheckpointError` naming the file when it is missing, damaged, or would need
    anything but tensors and plain values to load (``unsafe``: never loaded)."""
    path = Path(path)
    f = path / "state.pt" if path.is_dir() else path
    if not f.is_file():
        raise CheckpointError(f"checkpoint: expected a state.pt file, got {str(f)!r} (no such file)")
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        msg = " ".join(str(e).split())
        # torch names the global the file asks for: "unsupported GLOBAL posix.system whose module
        # posix is blocked" (a crafted or foreign file); other unpickling errors are damage
        what = re.search(r"unsupported global[^.]*", msg, re.IGNORECASE)
        if what:
            raise CheckpointError(
                f"checkpoint {str(f)!r}: refused to load: it needs more than tensors and plain values"
                f" ({what.group(0)}); it was not written by this version of tokencredit, or was altered",
                unsafe=True,
            ) from None
        raise CheckpointError(f"checkpoint {str(f)!r}: damaged or truncated ({msg[:200]})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        msg = " ".join(str(e).split())
        raise CheckpointError(f"checkpoint {str(f)!r}: damaged or truncated ({type(e).__name__}: {msg[:200]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(f)!r}: expected a dict of states, got {type(state).__name__}")
    return state


def load_latest_checkpoint(root: str | os.PathLike) -> Tuple[Path, Dict[str, Any]]:
    """The newest checkpoint under ``root`` that loads, and its state.

    A damaged one (truncated by a full disk or a copy cut short) is skipped with a
    :class:`CheckpointWarning` naming it, and the next newest is tried. A refused (unsafe) file
    is an error, not skipped. Raises :class:`CheckpointError` when there is no usable one."""
    root = Path(root)
    cps = _checkpoints(root)
    if not cps:
        raise CheckpointError(f"checkpoint: expected a step_XXXXXXXX checkpoint under {str(root)!r}, found none")
    skipped = []
    for ck in reversed(cps):
        try:
            state = load_checkpoint(ck)
        except CheckpointError as e:
            if e.unsafe:
                raise
            skipped.append(ck)
            warnings.warn(f"{e}; skipping it and trying the previous checkpoint", CheckpointWarning, stacklevel=2)
            continue
        if skipped:
            warnings.warn(
                f"using {str(ck)!r} instead of the damaged {', '.join(repr(str(s)) for s in skipped)}",
                CheckpointWarning, stacklevel=2,
            )
        return ck, state
    raise CheckpointError(
        f"checkpoint: every checkpoint under {str(root)!r} is damaged ({', '.join(str(s.name) for s in skipped)})"
    )

"""Atomic checkpoints: written to a temporary directory, then renamed into place.

A checkpoint holds everything a run needs to continue exactly: trainable weights (the adapter
only under LoRA), optimizer and scheduler, critic, RNG states, step, data position and the
credit method's state (STARE's controller). The last ``keep_last`` are kept.

Every value is a tensor or a plain Python value (dict, list, tuple, str, int, float, bool,
None), so a checkpoint is read with ``torch.load(weights_only=True)``: loading a file can never
run code. A file that needs more (a crafted pickle, or one not written by tokencredit) is
refused with a :class:`CheckpointError` that names it.

A checkpoint is checked, never trusted: ``state.pt.sha256`` (``sha256sum``'s format) holds the
sha256 of ``state.pt``'s bytes, written with it, and :func:`load_checkpoint` compares it (bytes
changed in place fail); every weight tensor (``model``, ``critic``) must be finite, at save (a
non-finite one is never written: the last good checkpoint stays the newest) and at load; and
:func:`check_weights` / :func:`copy_weights` hold the weights against the model they go into:
every trainable weight present, none extra, each of the model's shape and dtype (a scalar never
broadcasts into a matrix). Each refusal is one line naming the tensor, what was expected and
what the file holds. A damaged newest checkpoint (truncated, changed, non-finite, not matching
the model) is skipped with a warning by :func:`load_latest_checkpoint`, which falls back to the
newest intact one; the ``.tmp_step_*`` folders a kill during a save leaves behind are removed at
the next save, and a save that fails (a full disk) removes its own at once and says so in one line.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from ..errors import CheckpointError, CheckpointWarning, ConfigError, DiskFullError, is_disk_full
from .processes import process_tag, stale_temporaries

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "check_output_dir",
    "check_weights",
    "copy_weights",
    "file_sha256",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "load_weights",
    "rng_state",
    "save_checkpoint",
    "save_torch",
    "set_rng_state",
]

_PATTERN = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp_step_"
#: the checksum written beside ``state.pt`` (``sha256sum -c state.pt.sha256`` checks it too)
CHECKSUM_NAME = "state.pt.sha256"
#: the parts of a checkpoint that hold weights: checked finite at save and at load
_WEIGHTS = ("model", "critic")


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


def list_checkpoints(root: str | os.PathLike) -> List[Path]:
    """The checkpoint folders ``step_XXXXXXXX`` under ``root``, oldest step first (none: ``[]``)."""
    root = Path(root)
    if not root.exists():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Optional[Path]:
    """The newest checkpoint folder under ``root`` (not loaded, not checked), or None."""
    cps = list_checkpoints(root)
    return cps[-1] if cps else None


def check_output_dir(path: str | os.PathLike, field: str = "output_dir") -> None:
    """Raise ``ConfigError`` unless ``path`` is (or can be created as) a writable directory.
    Creates nothing: the nearest existing ancestor must be a writable directory."""
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
    disk, the KeyboardInterrupt of a Ctrl-C or SIGTERM handled there) is kept here. The bytes
    are hashed as they are written (``sha256``)."""

    def __init__(self, f):
        self.f = f
        self.error: Optional[BaseException] = None
        self.sha256 = hashlib.sha256()

    @property
    def name(self) -> str:
        return self.f.name

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except BaseException as e:
            self.error = e
            raise
        self.sha256.update(memoryview(data)[:n])
        return n

    def flush(self) -> None:
        self.f.flush()


def save_torch(obj: Any, path: str | os.PathLike) -> str:
    """``torch.save(obj)`` into ``path``, flushed and fsynced; returns the sha256 of its bytes.

    A failed write raises the file's own exception (a full disk: the ``OSError`` with its
    ``errno``, where torch alone raises a RuntimeError of its zip writer); the partial file is
    left for the caller to remove (it owns the temporary name)."""
    with open(path, "wb") as f:
        out = _CheckpointFile(f)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is not None:  # the file's own exception, not torch's wrapping of it
                raise out.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return out.sha256.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- weights: finite, and of the model they go into ---------------------------------------------


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {str(v.dtype).replace('torch.', '')} tensor of shape {tuple(v.shape)}"
    return "none" if v is None else f"a {type(v).__name__}"


def _non_finite(state: Mapping[str, Any]) -> Optional[Tuple[str, int]]:
    """The first weight tensor of ``state`` (its model and critic weights) holding a NaN or inf:
    ("model weight 'name'", how many), or None."""
    for part in _WEIGHTS:
        weights = state.get(part)
        if not isinstance(weights, Mapping):
            continue
        for name, v in weights.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                bad = int((~torch.isfinite(v)).sum())
                if bad:
                    return f"{part} weight {name!r}", bad
    return None


def check_weights(weights: Any, expected: Mapping[str, torch.Tensor], where: str, part: str = "model") -> None:
    """Raise :class:`CheckpointError` unless ``weights`` (name -> tensor, from a checkpoint) has
    exactly the names of ``expected`` (the model's trainable parameters, or a module's
    ``state_dict``), each a tensor of the same shape and dtype. One line: ``where``, the weight,
    what was expected and what the checkpoint holds."""
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{where}: {part} weights: expected a dict of tensors, got {_describe(weights)}")
    for name, want in expected.items():
        got = weights.get(name)
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype):
            what = "none (the checkpoint lacks it)" if name not in weights else _describe(got)
            raise CheckpointError(f"{where}: {part} weight {name!r}: expected {_describe(want)}, got {what}")
    extra = sorted(n for n in weights if n not in expected)
    if extra:
        raise CheckpointError(
            f"{where}: {part} weight {extra[0]!r}: expected none (not a trainable weight of this model; another "
            f"base model or setting?), got {_describe(weights[extra[0]])}"
        )


def trainable_weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The weights a checkpoint holds for ``model``: its parameters that train (all of them, or
    a LoRA adapter's)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def copy_weights(model: torch.nn.Module, weights: Any, where: str) -> None:
    """Copy a checkpoint's ``weights`` into ``model``'s trainable parameters, after
    :func:`check_weights` (so nothing is broadcast, and no weight is left as it was)."""
    params = trainable_weights(model)
    check_weights(weights, params, where)
    with torch.no_grad():
        for n, v in weights.items():
            params[n].copy_(v)


def load_weights(state: Mapping[str, Any], model: torch.nn.Module, critic: Optional[torch.nn.Module] = None,
                 where: str = "checkpoint") -> None:
    """A checkpoint's weights into ``model`` (its trainable parameters, :func:`copy_weights`) and,
    given ``critic``, the value head's; every weight is checked (:func:`check_weights`, one line
    naming ``where`` and the first weight that is not the model's) before any is copied, so a
    refused checkpoint leaves both as they were."""
    if critic is not None:
        check_weights(state.get("critic"), critic.state_dict(), where, part="critic")
    copy_weights(model, state.get("model"), where)
    if critic is not None:
        critic.load_state_dict(state["critic"])


def save_checkpoint(root: str | os.PathLike, step: int, state: Dict[str, Any], keep_last: int = 2) -> Path:
    """Write ``state`` as ``root/step_XXXXXXXX/state.pt`` (and its ``state.pt.sha256``)
    atomically and prune old ones.

    Weights holding a NaN or inf are never written (:class:`~tokencredit.train.update.NonFiniteError`,
    one line naming the tensor; the last good checkpoint stays the newest). Temporary folders
    left by a save that was killed (``.tmp_step_*``) are removed first. A save that fails (a
    full disk: :class:`~tokencredit.errors.DiskFullError`, one line) removes its temporary
    folder and leaves every earlier checkpoint as it was."""
    root = Path(root)
    bad = _non_finite(state)
    if bad is not None:
        from .update import NonFiniteError

        last = latest_checkpoint(root)
        raise NonFiniteError(
            f"checkpoint of step {step} not written: {bad[0]} holds {bad[1]} non-finite value(s) (NaN or inf); "
            + (f"the last good checkpoint ({last}) is left as it was" if last else "there is no earlier checkpoint")
        )
    root.mkdir(parents=True, exist_ok=True)
    for leftover in stale_temporaries(root, _TMP_PREFIX):  # never a live process's (processes)
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"{_TMP_PREFIX}{step:08d}_{process_tag()}"
    try:
        tmp.mkdir()
        digest = save_torch(state, tmp / "state.pt")
        with open(tmp / CHECKSUM_NAME, "w") as f:
            f.write(f"{digest}  state.pt\n")
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
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _check_sha256(f: Path) -> bool:
    """Compare ``f``'s bytes with the sha256 saved beside it (``state.pt.sha256``); False when
    there is none (a checkpoint written before tokencredit recorded one)."""
    sums = f.with_name(CHECKSUM_NAME)
    if not sums.is_file():
        return False
    try:
        want = sums.read_text().split()[0].lower()
    except (OSError, UnicodeDecodeError, IndexError):
        want = "unreadable"
    got = file_sha256(f)
    if got != want:
        raise CheckpointError(f"checkpoint {str(f)!r}: damaged: its sha256 is {got[:16]}..., expected {want[:16]}... "
                              f"(saved with it in {CHECKSUM_NAME}): changed or cut short since it was written")
    return True


def load_checkpoint(path: str | os.PathLike) -> Dict[str, Any]:
    """Read a checkpoint folder (or its ``state.pt``) with ``weights_only=True``, checked.

    Raises :class:`CheckpointError` naming the file when it is missing, damaged (cut short, or
    its bytes differ from its ``state.pt.sha256``), holds non-finite weights, or would need
    anything but tensors and plain values to load (``unsafe``: never loaded). The weights are
    held against a model by :func:`check_weights` / :func:`copy_weights`."""
    path = Path(path)
    f = path / "state.pt" if path.is_dir() else path
    if not f.is_file():
        raise CheckpointError(f"checkpoint: expected a state.pt file, got {str(f)!r} (no such file)")
    verified = _check_sha256(f)
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
    bad = _non_finite(state)
    if bad is not None:
        raise CheckpointError(f"checkpoint {str(f)!r}: {bad[0]}: expected finite values, got {bad[1]} NaN or inf")
    if not verified:  # said once it loaded: a refusal stays one line
        warnings.warn(f"checkpoint {str(f)!r} has no {CHECKSUM_NAME} (written by an older tokencredit, or removed): "
                      f"its bytes are not verified", CheckpointWarning, stacklevel=2)
    return state


def load_latest_checkpoint(
    root: str | os.PathLike, verify: Optional[Callable[[Path, Dict[str, Any]], None]] = None,
) -> Tuple[Path, Dict[str, Any]]:
    """The newest checkpoint under ``root`` that loads and passes ``verify``, and its state.

    A damaged one (truncated by a full disk or a copy cut short, bytes that differ from its
    checksum, non-finite weights, or weights ``verify(path, state)`` refuses with a
    :class:`CheckpointError`: not the model's) is skipped with a :class:`CheckpointWarning`
    naming it, and the next newest is tried. A refused (unsafe) file is an error, not skipped.
    Raises :class:`CheckpointError` when there is no usable one (naming why the newest is not)."""
    root = Path(root)
    cps = list_checkpoints(root)
    if not cps:
        raise CheckpointError(f"checkpoint: expected a step_XXXXXXXX checkpoint under {str(root)!r}, found none")
    skipped, newest_why = [], None
    for i, ck in enumerate(reversed(cps)):
        try:
            state = load_checkpoint(ck)
            if verify is not None:
                verify(ck, state)
        except CheckpointError as e:
            if e.unsafe:
                raise
            skipped.append(ck)
            newest_why = newest_why or str(e)
            if i + 1 < len(cps):  # (the oldest: the error below says why)
                warnings.warn(f"{e}; skipping it and trying the previous checkpoint", CheckpointWarning, stacklevel=2)
            continue
        if skipped:
            warnings.warn(
                f"using {str(ck)!r} instead of the damaged {', '.join(repr(str(s)) for s in skipped)}",
                CheckpointWarning, stacklevel=2,
            )
        return ck, state
    raise CheckpointError(
        f"checkpoint: every checkpoint under {str(root)!r} is damaged ({', '.join(str(s.name) for s in skipped)}); "
        f"the newest: {newest_why}"
    )

"""A run folder belongs to one run: ownership, a lock, and writes a kill cannot tear.

* :func:`check_run_folder` (before any model loads) and :func:`claim_run_folder` (when the run
  starts): a fresh ``train`` into a folder that holds a run (``config.json``,
  ``metrics.jsonl`` or ``checkpoints/``) is refused in one line: ``--resume`` continues it,
  ``--overwrite`` starts again after moving the old run's files aside into a sibling folder
  ``<name>.old-<k>`` (nothing is deleted).
* :class:`RunLock`: an exclusive lock held for the run's life, on ``<run>/.lock`` (``filelock``)
  and on the folder itself (an ``flock`` on the directory: deleting ``.lock`` by hand does not
  free the folder); a second run on the folder is refused with a line naming the holder's pid.
  The kernel drops the locks when their process dies, so a killed run never leaves the folder
  locked. :func:`stale_temporaries`: the temporary entries (``<prefix>..._<pid>-<start>``) whose
  writer is dead, the only ones a checkpoint save prunes.
* :class:`MetricsWriter`: ``metrics.jsonl`` written a whole record at a time (one ``write`` of
  the line, then ``fsync``), strict JSON (a non-finite value is ``null``, said once per metric); a record a failed write left half-written is cut off again; on
  open a torn last line (a kill inside a write) is removed with a warning, and a resumed run
  drops the rows past its checkpoint's step (they are trained again), so no row is lost or
  logged twice. :func:`read_metrics` reads the file and skips a damaged line with a warning.
* :func:`write_atomic`: a small file written to a temporary sibling and renamed into place;
  a full disk is a :class:`DiskFullError` (one line) and leaves no temporary file.
* :class:`RunLog`: a run's logs as it opens them: ``config.json`` (atomic), the sha256 of its
  data files (``data_fingerprint.json``, ``datasource.data_fingerprint``), ``metrics.jsonl`` (a
  :class:`MetricsWriter`), TensorBoard and W&B when asked.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..errors import ConfigError, DiskFullError, RunFolderError, RunFolderWarning, is_disk_full  # noqa: F401 (re-exported)
from .processes import process_alive, process_tag, stale_temporaries, start_time  # noqa: F401 (re-exported)

__all__ = [
    "RUN_FILES",
    "DiskFullError",
    "MetricsWriter",
    "RunFolder",
    "RunFolderError",
    "RunFolderWarning",
    "RunLock",
    "RunLog",
    "RunModel",
    "aside_name",
    "check_data_unchanged",
    "check_run_folder",
    "claim_run_folder",
    "holds_run",
    "process_alive",
    "process_tag",
    "read_metrics",
    "stale_temporaries",
    "write_atomic",
]

#: the entries that make a folder a run's (their presence refuses a fresh ``train``)
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints")
#: the sha256 of the data files a run trains on (``datasource.data_fingerprint``), checked on resume
FINGERPRINT_NAME = "data_fingerprint.json"
#: what ``--overwrite`` moves aside: the run's own entries (anything else in the folder stays)
RUN_ENTRIES = RUN_FILES + ("eval", "final", "tensorboard", "wandb", FINGERPRINT_NAME)
LOCK_NAME = ".lock"
PID_NAME = ".lock.pid"


# -- ownership -----------------------------------------------------------------------------


def holds_run(path: os.PathLike | str) -> List[str]:
    """The run entries (:data:`RUN_FILES`) present in ``path``."""
    p = Path(path)
    return [name for name in RUN_FILES if (p / name).exists()]


def aside_name(path: os.PathLike | str) -> Path:
    """Where ``--overwrite`` moves ``path`` (a run folder, or a file a command would replace):
    the first free sibling ``<name>.old-<k>``, k = 1, 2, ...; nothing is deleted."""
    path = Path(path)
    k = 1
    while (path.parent / f"{path.name}.old-{k}").exists():
        k += 1
    return path.parent / f"{path.name}.old-{k}"


def _refusal(path: Path, found: List[str]) -> RunFolderError:
    if not any((path / "checkpoints").glob("step_*")):  # killed before its first checkpoint: nothing to resume
        return RunFolderError(
            f"output_dir: {str(path)!r} holds a run that stopped before its first checkpoint ({', '.join(found)}); "
            f"start again with --overwrite (the old run is moved to {str(aside_name(path))!r}, nothing is deleted), "
            f"or choose another --output-dir"
        )
    return RunFolderError(
        f"output_dir: {str(path)!r} already holds a run ({', '.join(found)}); continue it with --resume, "
        f"start again with --overwrite (the old run is moved to {str(aside_name(path))!r}, nothing is deleted), "
        f"or choose another --output-dir"
    )


def _cannot_move_aside(path: Path, aside: Path, e: OSError) -> RunFolderError:
    return RunFolderError(f"overwrite: expected to move the old run aside into {str(aside)!r}, got {type(e).__name__} "
                          f"({e.strerror or e}); make {str(path.parent)!r} writable, or choose another --output-dir")


def check_run_folder(path: os.PathLike | str, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before any model loads, a run this folder cannot take: a fresh run where a run
    is (without ``overwrite``), ``resume`` with ``overwrite``, or a folder another live run
    holds (the message names its pid)."""
    p = Path(path)
    if resume and overwrite:
        raise RunFolderError("overwrite: expected false with --resume (--resume continues the run, --overwrite "
                             "moves it aside and starts again), got true")
    found = holds_run(p)
    if found and not resume and not overwrite:
        raise _refusal(p, found)
    if found and overwrite:  # the old run must be movable aside: a read-only parent refuses now, not later
        aside = aside_name(p)
        try:
            aside.mkdir()
            aside.rmdir()
        except OSError as e:
            raise _cannot_move_aside(p, aside, e) from None
    if p.is_dir():
        RunLock(p).probe()  # only to say who holds it, before a model loads


def _holder_of(folder: Path) -> str:
    """The pid that holds ``folder``: its holder record (``.lock.pid``: pid and start time), else
    the kernel's lock table (``/proc/locks``, where a deleted record cannot hide it)."""
    try:
        pid, *start = (folder / PID_NAME).read_text().split()
        if process_alive(int(pid), start[0] if start else None):
            return pid
    except (OSError, ValueError):
        pass
    try:
        st = os.stat(folder)
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == dev:
                    return parts[4]
    except OSError:
        pass
    return "unknown"


class RunLock:
    """An exclusive lock on a run folder for the run's life, on two things: ``<folder>/.lock``
    (``filelock.FileLock``, non-blocking) and the folder itself (an ``flock`` on the directory,
    which no one deletes without deleting the run: a second run is refused even after
    ``rm .lock``). The holder's pid and start time are written to ``.lock.pid``."""

    def __init__(self, folder: os.PathLike | str):
        from filelock import FileLock

        self.folder = Path(folder)
        self._lock = FileLock(str(self.folder / LOCK_NAME))
        self._dir_fd: Optional[int] = None

    def _in_use(self) -> RunFolderError:
        return RunFolderError(
            f"output_dir: {str(self.folder)!r} is in use by another run (pid {_holder_of(self.folder)}); wait for it to end, "
            f"stop it, or choose another --output-dir"
        )

    def _lock_folder(self) -> None:
        """``flock`` the folder itself (where the file system has no ``flock`` on a directory,
        the holder record's liveness stands in for it)."""
        import fcntl

        fd = os.open(self.folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use() from None
        except OSError:  # no flock on directories here (some network file systems)
            os.close(fd)
            if _holder_of(self.folder) not in ("unknown", str(os.getpid())):
                raise self._in_use() from None
            return
        self._dir_fd = fd

    def _lock_file(self) -> None:
        from filelock import Timeout

        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise self._in_use() from None

    def probe(self) -> None:
        """Raise the refusal of :meth:`acquire` if another run holds the folder; take nothing
        and write nothing."""
        if (self.folder / LOCK_NAME).exists():
            self._lock_file()
        try:
            self._lock_folder()
        finally:
            self._release_locks()

    def acquire(self) -> "RunLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_file()
        try:
            self._lock_folder()
            (self.folder / PID_NAME).write_text(f"{os.getpid()}\n{start_time(os.getpid()) or ''}\n")
        except BaseException:
            self._release_locks()
            raise
        return self

    def _release_locks(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # drops the folder's flock
            self._dir_fd = None
        self._lock.release()

    def release(self) -> None:
        if self._lock.is_locked:
            try:
                (self.folder / PID_NAME).unlink()
            except OSError:
                pass
            self._release_locks()


def claim_run_folder(path: os.PathLike | str, *, resume: bool, overwrite: bool, log=print) -> RunLock:
    """Take the folder's lock for this run and return it (release it when the run ends).

    Under the lock the folder is checked again (a run may have been written since
    :func:`check_run_folder`); with ``overwrite`` the old run's entries are moved into
    ``<name>.old-<k>`` next to the folder, and ``log`` says where."""
    p = Path(path)
    lock = RunLock(p).acquire()
    try:
        found = holds_run(p)
        if found and not resume:
            if not overwrite:
                raise _refusal(p, found)
            aside = aside_name(p)
            try:
                aside.mkdir()
                for name in RUN_ENTRIES:
                    if (p / name).exists():
                        os.replace(p / name, aside / name)
            except OSError as e:
                raise _cannot_move_aside(p, aside, e) from None
            log(f"--overwrite: the old run in {str(p)!r} was moved to {str(aside)!r}")
    except BaseException:
        lock.release()
        raise
    return lock


# -- the data it trained on ----------------------------------------------------------------


def _changes(value: str, was: Mapping[str, str], now: Mapping[str, str]) -> List[str]:
    if Path(value).is_file() and len(was) == 1 and set(was) == set(now):
        return [f"{value!r} changed (sha256 {next(iter(was.values()))[:12]} -> {next(iter(now.values()))[:12]})"]
    out = []
    for f in sorted(set(was) | set(now)):
        if f not in now:
            out.append(f"{f} removed")
        elif f not in was:
            out.append(f"{f} added")
        elif was[f] != now[f]:
            out.append(f"{f} changed (sha256 {was[f][:12]} -> {now[f][:12]})")
    return [f"{value!r}: " + ", ".join(out)]


def check_data_unchanged(folder: os.PathLike | str, config: Mapping[str, Any]) -> None:
    """Refuse to resume the run in ``folder`` on data files that differ from those it trained
    on (its :data:`FINGERPRINT_NAME`), as a changed setting is refused: a ``ConfigError`` naming
    each setting and file. No record (a run written before it, data from the hub) or a path
    that is not there (the loader says so) is no objection."""
    from ..data.datasource import DATA_FIELDS, data_fingerprint, setting

    try:
        saved = json.loads((Path(folder) / FINGERPRINT_NAME).read_text())
    except (OSError, ValueError):
        return
    if not isinstance(saved, dict):
        return
    now = data_fingerprint(config)
    diffs = []
    for name in DATA_FIELDS:
        was, cur = saved.get(name), now.get(name)
        if isinstance(was, dict) and cur is not None and was != cur:
            diffs += [f"{name} {c}" for c in _changes(setting(config, name), was, cur)]
    if diffs:
        raise ConfigError(
            f"resume: the run in {str(folder)!r} was trained on other data: {'; '.join(diffs)} ({FINGERPRINT_NAME} "
            f"records the files it trained on). Resume with those files or train in a new output_dir"
        )


# -- writes ----------------------------------------------------------------------------------


def write_atomic(path: os.PathLike | str, text: str, what: Optional[str] = None) -> None:
    """``text`` into ``path`` through a temporary sibling renamed into place (fsynced): a kill
    leaves the old file or the new one. A full disk is a :class:`DiskFullError` and leaves
    no temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if is_disk_full(e):
            raise DiskFullError(path, what or path.name, e) from None
        raise


def _row_step(line: bytes) -> Optional[float]:
    try:
        row = json.loads(line)
        return float(row["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsWriter:
    """Append-only ``metrics.jsonl``: one ``write`` of a whole line, then ``fsync``.

    On open a torn last line is cut off with a :class:`RunFolderWarning`; with ``resume_step``
    (the step of the checkpoint a run resumes from) the rows of later steps are dropped, with
    a line through ``log``: those steps are trained and logged again."""

    def __init__(self, path: os.PathLike | str, *, resume_step: Optional[int] = None, log=print):
        self.path = Path(path)
        self._said: set = set()  # the metrics already said to be non-finite
        if self.path.exists():
            self._repair(resume_step, log)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)

    def _repair(self, resume_step: Optional[int], log) -> None:
        data = self.path.read_bytes()
        keep = data
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            keep = data[:cut]
            warnings.warn(
                f"{self.path}: a torn last line ({len(data) - cut} bytes, a write cut short by a kill) was removed",
                RunFolderWarning, stacklevel=3,
            )
        if resume_step is not None:
            lines = keep.splitlines(keepends=True)
            later = [s for s in (_row_step(ln) for ln in lines) if s is not None and s > resume_step]
            if later:
                keep = b"".join(ln for ln in lines if not ((s := _row_step(ln)) is not None and s > resume_step))
                log(f"metrics.jsonl: {len(later)} row(s) of steps past the checkpoint (step {resume_step}) removed; "
                    f"those steps are trained again")
        if keep != data:
            write_atomic(self.path, keep.decode("utf-8", errors="surrogateescape"), "metrics.jsonl")

    def _write_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def _json_numbers(self, row: Dict[str, Any]) -> Dict[str, Any]:
        """``row`` with each non-finite float (inf, -inf, NaN: not JSON numbers, which
        ``json.dumps`` writes as ``Infinity`` / ``NaN``) as ``None`` (``null``), said once per
        metric with a :class:`RunFolderWarning`."""
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if not bad:
            return row
        for k in bad:
            if k not in self._said:
                self._said.add(k)
                warnings.warn(f"metrics.jsonl: {k} is {row[k]}, not a JSON number; written as null",
                              RunFolderWarning, stacklevel=4)
        return {k: (None if k in bad else v) for k, v in row.items()}

    def write(self, row: Dict[str, Any]) -> None:
        data = (json.dumps(self._json_numbers(row), allow_nan=False) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            self._write_bytes(data)
            os.fsync(self._fd)
        except (Exception, KeyboardInterrupt) as e:  # a full disk, or a Ctrl-C / SIGTERM handled mid-write
            try:  # never leave half a record behind
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            if is_disk_full(e):
                raise DiskFullError(self.path, "metrics.jsonl", e) from None
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_metrics(path: os.PathLike | str) -> List[Dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` in file order. A line that is not a JSON object (a torn
    last line, damage) is skipped with a :class:`RunFolderWarning` naming the file and line.
    A missing file is ``[]``."""
    path = Path(path)
    if not path.exists():
        return []
    if not path.is_file():
        raise RunFolderError(f"metrics: expected a file, got {str(path)!r}, which is a directory")
    data = path.read_bytes()
    rows = []
    lines = data.split(b"\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            row = None
        if not isinstance(row, dict):
            torn = i == len(lines) and not data.endswith(b"\n")
            warnings.warn(f"{path}:{i}: {'a torn last line' if torn else 'not a JSON object'}, skipped",
                          RunFolderWarning, stacklevel=2)
            continue
        rows.append(row)
    return rows


class RunLog:
    """The logs of a run as it starts: ``config.json`` written (atomically), ``metrics.jsonl``
    opened for whole-line appends (a torn last line cut off; ``resume_step``: the rows past the
    checkpoint dropped), TensorBoard (``<folder>/tensorboard``) and W&B when asked.
    :meth:`write` logs one row to all of them."""

    def __init__(self, folder: os.PathLike | str, config: Dict[str, Any], *, resume_step: Optional[int] = None,
                 tensorboard: bool = False, wandb_project: Optional[str] = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(self.folder / "config.json", json.dumps(config, indent=2), "config.json")
        from ..data.datasource import data_fingerprint

        data = data_fingerprint(config)  # the sha256 of the data files it trains on (checked on resume)
        if data:
            write_atomic(self.folder / FINGERPRINT_NAME, json.dumps(data, indent=2), FINGERPRINT_NAME)
        self.metrics = MetricsWriter(self.folder / "metrics.jsonl", resume_step=resume_step)
        self._writers: List[Any] = []
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(str(self.folder / "tensorboard"))
            self._writers.append(lambda m, s: [tb.add_scalar(k, v, s) for k, v in m.items()])
        if wandb_project is not None:
            import wandb

            wandb.init(project=wandb_project, config=config, dir=str(self.folder))
            self._writers.append(lambda m, s: wandb.log(m, step=s))

    def write(self, metrics: Dict[str, float], step: int) -> None:
        self.metrics.write(metrics)  # a whole line, fsynced
        for w in self._writers:
            w(metrics, step)

    def close(self) -> None:
        self.metrics.close()


# -- reading a run ---------------------------------------------------------------------------


@dataclass
class RunModel:
    """A run's model as :meth:`RunFolder.load_model` gives it."""

    config: Any  # the run's TrainConfig
    model: Any  # its base model (with its LoRA adapter where it trained one), the checkpoint's weights in it
    tokenizer: Any
    checkpoint: Optional[Path]  # the checkpoint folder the weights are from; None: the initial weights
    state: Optional[Dict[str, Any]]  # that checkpoint's state (its step, the critic's weights, ...)
    critic: Optional[Any] = None  # the checkpoint's value head (models.ValueHead), when asked for


class RunFolder:
    """A run's folder, read: its settings (``config.json``), its checkpoints
    (``checkpoints/step_XXXXXXXX``) and its model. The commands that read a run (``eval --run``,
    ``export``, ``fidelity``, ``compare``, ``--resume``) read it through this.

    A folder that is not a run's is one line of ``error`` (a :class:`ConfigError` unless the
    command has its own) naming ``arg``, the argument that named the folder (``RUN``, ``--run``).
    Checkpoints are loaded and checked by the ``checkpoint`` module (their sha256, finite weights,
    every weight of the model's shape and dtype)."""

    def __init__(self, path: os.PathLike | str, *, arg: str = "RUN", error: type = ConfigError):
        self.path = Path(path)
        self.arg = arg
        self.error = error
        self._config: Any = None

    @property
    def config_file(self) -> Path:
        return self.path / "config.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    # -- settings

    def saved_config(self) -> Optional[Dict[str, Any]]:
        """``config.json`` as plain values; None where there is none or it is not a JSON object
        (the comparisons of a run's settings read it so: there, the checkpoint's own copy decides)."""
        try:
            data = json.loads(self.config_file.read_text())
        except (OSError, ValueError):  # missing, unreadable, not JSON or not UTF-8
            return None
        return data if isinstance(data, dict) else None

    def config(self):
        """The run's settings: ``config.json`` read back into a ``TrainConfig``, each field checked
        for its type and range (``config.config_from_dict``). A folder without one, or a file that
        is not JSON, is one line."""
        if self._config is None:
            from .config import config_from_dict

            f = self.config_file
            if not f.is_file():
                raise self.error(f"{self.arg}: expected a tokencredit run folder (with config.json), got {str(self.path)!r}")
            try:
                data = json.loads(f.read_text())
            except ValueError as e:  # not JSON, or not UTF-8
                raise self.error(f"{self.arg}: {f} is not valid JSON ({e})") from None
            self._config = config_from_dict(data, "config.json")
        return self._config

    # -- checkpoints

    def checkpoints(self) -> List[Path]:
        """The checkpoint folders, oldest step first."""
        from .checkpoint import list_checkpoints

        return list_checkpoints(self.checkpoints_dir)

    def steps(self) -> List[int]:
        """The steps the run holds a checkpoint of, in order."""
        return [int(p.name.rsplit("_", 1)[1]) for p in self.checkpoints()]

    def latest(self) -> Optional[Path]:
        """The newest checkpoint folder (not loaded, not checked), or None when there is none."""
        found = self.checkpoints()
        return found[-1] if found else None

    def checkpoint(self, step: Optional[int] = None) -> Path:
        """The checkpoint folder of ``step`` (None: the newest); a run without one, or a step it
        holds no checkpoint of, is one line."""
        have = self.steps()
        if step is None:
            if not have:
                raise self.error(f"{self.arg}: expected a checkpoint under {str(self.checkpoints_dir)!r}, found none "
                                 f"(the run stopped before its first)")
            step = have[-1]
        elif step not in have:
            raise self.error(f"--checkpoint: expected one of the run's checkpoint steps {have}, got {step}")
        return self.checkpoints_dir / f"step_{step:08d}"

    def load_checkpoint(self, step: Optional[int] = None) -> Tuple[Path, Dict[str, Any]]:
        """The checkpoint of ``step`` (None: the newest) and its state, loaded and checked
        (``checkpoint.load_checkpoint``: a damaged one is a ``CheckpointError`` naming it)."""
        from .checkpoint import load_checkpoint

        ck = self.checkpoint(step)
        return ck, load_checkpoint(ck)

    def load_latest(self, verify=None) -> Tuple[Path, Dict[str, Any]]:
        """The newest intact checkpoint and its state: a damaged one (or one ``verify(path,
        state)`` refuses) is skipped with a warning and the one before is tried
        (``checkpoint.load_latest_checkpoint``)."""
        from .checkpoint import load_latest_checkpoint

        return load_latest_checkpoint(self.checkpoints_dir, verify=verify)

    # -- the model

    def load_model(self, checkpoint: Union[None, int, str, os.PathLike] = "latest", *, critic: bool = False,
                   state: Optional[Dict[str, Any]] = None) -> RunModel:
        """The run's model: its base model (``model.name``), with a LoRA adapter where it trained
        one, holding a checkpoint's weights: ``"latest"`` the newest checkpoint, an ``int`` that
        step's, a path that checkpoint folder's, None the initial weights. The checkpoint is loaded
        and checked before any model loads; its weights go in only when every trainable weight is
        there, of the model's shape and dtype (``checkpoint.load_weights``: nothing broadcast,
        nothing left as it was). ``critic``: the checkpoint's value head too (a run without one is
        refused before any model loads). ``state``: that checkpoint's state where the caller has
        loaded it already (:meth:`load_checkpoint`); ignored with the initial weights."""
        from .checkpoint import load_checkpoint, load_weights

        cfg = self.config()
        ck = None
        if isinstance(checkpoint, (int, type(None))) or checkpoint == "latest":
            if checkpoint is not None:
                ck = self.checkpoint(None if checkpoint == "latest" else checkpoint)
        else:
            ck = Path(checkpoint)
            if not ck.exists():
                raise self.error(f"--checkpoint: expected a checkpoint folder, got {str(ck)!r} (no such folder)")
        if ck is None:
            state = None
        elif state is None:
            state = load_checkpoint(ck)
        if critic and (state is None or state.get("critic") is None):
            from ..credit.registry import get_method, list_methods

            with_critic = " or ".join(n for n in list_methods() if get_method(n).critic is not None)
            raise self.error(f"{self.arg}: expected a checkpoint with a critic (a run of {with_critic}), got "
                             f"{str(ck) if ck is not None else 'none'} without one")
        from ..engine.models import ValueHead, add_lora, resolve_model

        model, tok = resolve_model(cfg.model.name, cache_dir=cfg.model.cache_dir)
        if cfg.model.lora:
            model = add_lora(model, r=cfg.model.lora_r, alpha=cfg.model.lora_alpha, target_modules=cfg.model.lora_targets)
        head = ValueHead(int(model.config.hidden_size)) if critic else None
        if ck is not None:
            load_weights(state, model, head, where=f"checkpoint {str(ck / 'state.pt') if ck.is_dir() else str(ck)!r}")
        return RunModel(cfg, model, tok, ck, state, head)

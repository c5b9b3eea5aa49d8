"""Starting, stopping and resuming a run: what the own trainer does around its steps.

* :func:`holding_run_folder`: the run folder's lock (``runfolder.claim_run_folder``) held for
  the run's life; a full disk on the way is one line saying where the run stopped and whether
  its last checkpoint is intact.
* :func:`check_resume_config` / :func:`resume_state`: ``--resume`` continues from the newest
  intact checkpoint (its checksum, finite weights, and every weight of the model's shape and
  dtype: a damaged one is skipped with a warning), refused in one line if the run was trained
  with other settings (only ``config.SAFE_TO_CHANGE`` may differ), or has no checkpoint yet (a
  run killed before its first: ``--overwrite`` starts it again).
* :class:`StopSignals`: SIGINT (Ctrl-C) and SIGTERM (schedulers, ``timeout``, container stops)
  let the running step finish, then the run checkpoints and stops; a second one, or one
  between steps, stops at once.
"""

from __future__ import annotations

import json
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from .checkpoint import check_weights, trainable_weights
from .config import SAFE_TO_CHANGE, ConfigError, config_diff
from .runfolder import (
    DiskFullError,
    RunFolder,
    RunFolderError,
    aside_name,
    check_data_unchanged,
    claim_run_folder,
    holds_run,
)

__all__ = ["StopSignals", "check_resume_config", "holding_run_folder", "resume_state"]


@contextmanager
def holding_run_folder(folder: Path, *, resume: bool, overwrite: bool, step: Callable[[], int]) -> Iterator[None]:
    """Hold ``folder``'s lock while the block runs (see ``runfolder.claim_run_folder``). A
    :class:`~tokencredit.train.runfolder.DiskFullError` leaving the block says at which step (``step()``)
    the run stopped and how to go on."""
    lock = claim_run_folder(folder, resume=resume, overwrite=overwrite)
    try:
        yield
    except DiskFullError as e:
        last = RunFolder(folder).latest()
        e.message += (f"; the run stopped at step {step()}; "
                      + (f"the last checkpoint ({last}) is intact: free space and continue with --resume" if last
                         else "no checkpoint yet: free space and start again with --overwrite"))
        raise
    finally:
        lock.release()


def check_resume_config(folder: Path, config: Dict[str, Any], saved: Any, where: Optional[Path] = None) -> None:
    """Refuse to resume the run in ``folder`` if it has no checkpoint (a run killed before its
    first one: ``--overwrite`` starts it again), or if its training-relevant settings differ
    from ``config`` (``config_to_dict`` of this run's config).

    ``saved`` is the run's config (a dict, or the path of its ``config.json``; a missing file
    is no objection: the checkpoint's own copy is checked when it is loaded). Only the fields
    in :data:`~tokencredit.train.config.SAFE_TO_CHANGE` may differ."""
    if RunFolder(folder).latest() is None:
        found = holds_run(folder)
        raise RunFolderError(
            f"resume: the run in {str(folder)!r} has no checkpoint to continue from "
            + ("(it stopped before its first one); start again with --overwrite (the old run is moved to "
               f"{str(aside_name(folder))!r}, nothing is deleted), or choose another --output-dir" if found
               else "(it holds no run); train without --resume")
        )
    if isinstance(saved, Path):  # (missing or unreadable: the checkpoint's copy decides)
        where, saved = saved, RunFolder(saved.parent).saved_config()
    if not isinstance(saved, dict):
        return
    diffs = config_diff(saved, json.loads(json.dumps(config)))
    if diffs:
        raise ConfigError(
            f"resume: the run in {str(folder)!r} was trained with other settings ({where}): "
            f"{'; '.join(diffs)}. Resume with its settings (only {', '.join(sorted(SAFE_TO_CHANGE))} "
            f"may change) or train in a new output_dir"
        )
    check_data_unchanged(folder, config)  # the sha256 of its data files (runfolder)


def resume_state(folder: Path, config: Dict[str, Any], model: Optional[torch.nn.Module] = None,
                 critic: Optional[torch.nn.Module] = None) -> Tuple[Path, Dict[str, Any]]:
    """The newest intact checkpoint of the run in ``folder`` and its state, refused if it was
    trained with other settings than ``config``. Intact: it loads, matches its checksum, its
    weights are finite and (given ``model`` / ``critic``) are exactly the model's trainable
    weights and the critic's, each of the same shape and dtype; a damaged one is skipped with a
    warning naming it and why."""

    def verify(ck: Path, sd: Dict[str, Any]) -> None:
        where = f"checkpoint {str(ck / 'state.pt')!r}"
        if model is not None:
            check_weights(sd.get("model"), trainable_weights(model), where)
        if critic is not None:
            check_weights(sd.get("critic"), critic.state_dict(), where, part="critic")

    ck, sd = RunFolder(folder).load_latest(verify=verify)
    check_resume_config(folder, config, sd.get("config"), where=ck / "state.pt")
    return ck, sd


class StopSignals:
    """SIGINT and SIGTERM while a run trains (installed by ``with``, in the main thread only).

    The first signal during a step (``busy``) lets the step finish: ``requested`` is set and the
    trainer checkpoints after the step and stops. A second one, or one while no step is running,
    raises ``KeyboardInterrupt`` at once. A step that was cut off half-way has already changed the
    data position, RNG and maybe the weights, so the trainer never checkpoints it. ``by`` names
    the first signal ("SIGINT" / "SIGTERM"), for the exit status."""

    def __init__(self) -> None:
        self.by: Optional[str] = None
        self.requested = False
        self.busy = False
        self._prev: Dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        self.by, self.requested, self.busy = None, False, False
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._prev[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._prev.items():
            signal.signal(sig, handler)
        self._prev = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.by = self.by or name
        if self.requested or not self.busy:
            raise KeyboardInterrupt
        self.requested = True
        what = "Ctrl-C" if signum == signal.SIGINT else name
        print(f"\n{what}: finishing this step, then writing a checkpoint ({what} again to stop now)", flush=True)

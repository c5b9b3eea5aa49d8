"""Which process wrote a file, and whether it still runs: a pid and its start time name one
process even after the pid is reused. A temporary entry a writer leaves (a checkpoint's
``.tmp_step_*``, an export's ``.NAME.tmp-*``, ...) ends in its writer's :func:`process_tag`, and
:func:`stale_temporaries` finds the ones whose writer is gone, the only ones a later writer may
remove. Linux's ``/proc`` gives the start times; without it a pid alone is used."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Optional

__all__ = ["process_alive", "process_tag", "stale_temporaries", "start_time"]


def start_time(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks since boot, field 22 of ``/proc/<pid>/stat``):
    with the pid it names one process, even after the pid is reused. None where there is no
    ``/proc`` or no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def process_alive(pid: int, start: Optional[str] = None) -> bool:
    """Whether process ``pid`` is running (and, given ``start``, is the process that started then,
    not a later one that got its pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    if start is not None:
        now = start_time(pid)
        return now is None or now == start
    return True


def process_tag(pid: Optional[int] = None) -> str:
    """``"<pid>-<start time>"`` of this process (or ``pid``), ``"<pid>"`` where start times are
    unknown: the suffix of a temporary entry, naming its writer even after its pid is reused."""
    pid = os.getpid() if pid is None else pid
    start = start_time(pid)
    return f"{pid}-{start}" if start else str(pid)


def stale_temporaries(root: os.PathLike | str, prefix: str) -> List[Path]:
    """The temporary entries ``<root>/<prefix>..._<tag>`` (:func:`process_tag`) whose writer is
    dead, or is this process (which writes one at a time). A live process's temporary entry is
    never one: a second process on the folder cannot remove it under its writer. An entry named
    by a pid alone is stale where start times are known (an older writer's), else when that pid
    is dead."""
    own = os.getpid()
    known = start_time(own) is not None
    out = []
    for p in Path(root).glob(f"{prefix}*"):
        m = re.search(r"_(\d+)(?:-(\d+))?$", p.name)
        if m is None:
            out.append(p)
            continue
        pid, start = int(m.group(1)), m.group(2)
        if pid == own or (start is None and known) or not process_alive(pid, start):
            out.append(p)
    return out

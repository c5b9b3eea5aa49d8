"""Keep freed memory in the process on CPU runs (``retain_memory``, default on).

glibc's ``malloc`` serves blocks above its mmap threshold (128 KiB, raised adaptively up to
32 MiB) with a fresh ``mmap`` and unmaps them on ``free``. A training step allocates and frees the
same large tensors every step (the gradients, ``zero_grad(set_to_none=True)``; the activations
kept for backward; the KV caches and the ``[rows, vocab]`` logits of every decode step), so
every step touches hundreds of MB of new pages and the kernel zero-fills each 4 KiB page on its
first touch. In a profile of one update of the embedded SmolLM2 (8 rows, 1 thread) that showed as
a 240 ms ``fill_`` of the 113 MB embedding gradient and 10-16 GFLOP/s (instead of 60-80) in the
weight-gradient GEMMs that write fresh outputs.

:func:`retain_freed_memory` sets ``M_MMAP_MAX = 0`` (every block comes from the heap) and a
trim threshold of 2 GiB, the largest ``mallopt`` takes (a freed block stays in the heap for the next step), through
``mallopt``, the calls the ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` environment variables
make at start-up. Measured (docs/performance.md, quiet AVX2 machine): the README run's 30 steps
334 -> 305 s, minor page faults 14.4 M -> 1.24 M, peak RSS 4.56 -> 4.73 GB, the same numbers;
``benchmarks/step_vs_trl.py``'s update phase 4.71 -> 4.36 s. The cost: the process keeps its peak
heap until it exits (it does not hand memory back to the OS between steps), and glibc's heap
grows by some fragmentation before it settles. The setting is process-wide and applies to
allocations made after it. Other C libraries (musl, macOS) have no ``mallopt``: nothing is done
there and the function returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["retain_freed_memory", "M_TRIM_THRESHOLD", "M_MMAP_MAX"]

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_TRIM = 2**31 - 1  # mallopt's value is a C int


def retain_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse; True if it was done (glibc), False elsewhere."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok = mallopt(M_TRIM_THRESHOLD, _TRIM) == 1 and ok
    return ok

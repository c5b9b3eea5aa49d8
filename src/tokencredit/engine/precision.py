"""Numeric precision of the own trainer (``--precision fp32|bf16|auto``).

``bf16``: generation runs on a bfloat16 copy of the policy's weights (``HFRollout(dtype=...)``,
re-synced from the fp32 weights whenever they change), and the signal passes and the update's
forward run under ``torch.autocast(dtype=bfloat16)``. The weights the optimizer updates, their
gradients and AdamW's state stay fp32. Measured on this project's CPU (``benchmarks/decode.py``,
``docs/performance.md``): a bf16 weight copy decodes faster than autocast, which re-casts every
weight at every decode step unless autocast's weight cache applies (it does not for frozen
weights, e.g. a LoRA base model); autocast is the usual mixed-precision recipe for training.

``auto`` picks bf16 where the hardware has bf16 matrix units (a CPU with ``amx_bf16`` or
``avx512_bf16``, a CUDA GPU that supports bf16) and fp32 elsewhere. The trainer resolves it
before anything else, so a run's ``config.json`` records the precision it trained in and a
resume that would resolve ``auto`` differently is refused like any other changed setting.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import ContextManager, Optional

import torch

__all__ = ["PRECISIONS", "cpu_has_bf16_units", "resolve_precision", "autocast", "bf16_attention", "dtype_of"]

PRECISIONS = ("fp32", "bf16", "auto")
_CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@lru_cache(maxsize=1)
def cpu_has_bf16_units() -> bool:
    """True when the CPU has bf16 matrix instructions (``amx_bf16`` or ``avx512_bf16`` in
    /proc/cpuinfo; where that file is absent, torch's oneDNN bf16 support query)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return any(x in flags for x in _CPU_BF16_FLAGS)
    except OSError:
        pass
    mkldnn = getattr(torch.backends, "mkldnn", None)
    try:
        return bool(mkldnn is not None and mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device).split(":")[0]


def resolve_precision(precision: str, device: str = "auto") -> str:
    """``"fp32"`` or ``"bf16"``: ``precision`` with ``auto`` resolved for ``device`` (a
    TrainConfig ``device`` string: auto, cpu, cuda, cuda:N, mps)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {list(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    kind = _device_type(device)
    if kind == "cuda":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if kind == "cpu":
        return "bf16" if cpu_has_bf16_units() else "fp32"
    return "fp32"


def dtype_of(precision: str) -> Optional[torch.dtype]:
    """The low-precision dtype of a resolved precision (None for fp32)."""
    return torch.bfloat16 if precision == "bf16" else None


@lru_cache(maxsize=1)
def bf16_flash_attention_broken() -> bool:
    """True on a CPU with AMX tiles when ATen's kernels are held below AVX-512
    (``ATEN_CPU_CAPABILITY=avx2`` or ``default``): torch 2.13's bf16 flash attention then packs its
    blocks for AMX and fails at 64 or more positions ("pack_vnni2 is only supported when avx512 is
    supported"). Measured on an Intel Xeon (AMX) under each capability; an AVX2-only CPU has no
    AMX and is unaffected."""
    cpu = getattr(torch, "cpu", None)
    try:
        amx = bool(cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False
    return amx and not torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def bf16_attention(device_type: str) -> ContextManager:
    """Scaled-dot-product attention that works in bf16 on this CPU: the math kernel where
    :func:`bf16_flash_attention_broken`, else torch's own choice (nothing changes)."""
    if device_type == "cpu" and bf16_flash_attention_broken():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def autocast(precision: str, device_type: str) -> ContextManager:
    """bf16 autocast for ``"bf16"`` (with :func:`bf16_attention`); nothing at all for ``"fp32"``
    (the fp32 path is unchanged)."""
    if precision == "bf16":
        return _bf16_autocast(device_type)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _bf16_autocast(device_type: str):
    with bf16_attention(device_type), torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        yield

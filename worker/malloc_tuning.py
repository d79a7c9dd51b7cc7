"""Keep freed tensor memory in the process instead of handing it back to the OS.

glibc serves big allocations with mmap and unmaps them on free, so every step's activations (tens of
MB on CPU) are page-faulted in again: measured here, that made a 1,800-token prefill 1.6x slower
(1.42 s vs 0.87 s). Raising the mmap and trim thresholds lets the heap reuse the memory.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def libc() -> ctypes.CDLL | None:
    """The C library, None where it cannot be loaded."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Returns False where this is not glibc (nothing to tune)."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    big = 1 << 30  # mallopt takes an int: 1 GiB is within range and above any single activation here
    ok = mallopt(_M_MMAP_THRESHOLD, big) and mallopt(_M_TRIM_THRESHOLD, big) and mallopt(_M_TOP_PAD, 64 << 20)
    return bool(ok)

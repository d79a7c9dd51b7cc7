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


def keep_freed_memory() -> bool:
    """Returns False where this is not glibc (nothing to tune)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    big = 1 << 30  # mallopt takes an int: 1 GiB is within range and above any single activation here
    ok = mallopt(_M_MMAP_THRESHOLD, big) and mallopt(_M_TRIM_THRESHOLD, big) and mallopt(_M_TOP_PAD, 64 << 20)
    return bool(ok)

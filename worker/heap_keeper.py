"""Hand the heap's free pages back to the OS now and then, and say how big the heap is.

`malloc_tuning.keep_freed_memory` stops glibc from unmapping freed tensors after every step (that made
prefill page-fault its activations every step). The price: the heap keeps the pages of the largest step
ever seen, so a rare big step (a long prompt with prompt logprobs, a wide mixed batch) raises the worker's
RSS for good, which over hours reads as a leak. Every `period_s` the keeper calls `malloc_trim(0)`, which
releases every whole free page of every arena; the next big step faults its pages in again, once a
period instead of once a step.

Each tick also reads `mallinfo2` (glibc >= 2.33): bytes in use (arena chunks plus mmapped blocks) and
bytes free in the arenas. In use growing is a leak; RSS growing with in use flat is pages held free.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

from tandem.protocol.heap_sample import HeapSample
from tandem.worker.malloc_tuning import libc


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class HeapKeeper:
    """`tick()` after each step (and when idle): at most once a period it trims and returns a sample."""

    def __init__(self, period_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s, self.clock = period_s, clock
        self.trims = 0
        self.released_bytes = 0  # RSS the trims gave back, summed
        self._last = clock()
        c = libc()
        self._mallinfo2 = getattr(c, "mallinfo2", None)
        self._trim = getattr(c, "malloc_trim", None)
        if self._mallinfo2 is not None:
            self._mallinfo2.restype, self._mallinfo2.argtypes = _Mallinfo2, []
        if self._trim is not None:
            self._trim.restype, self._trim.argtypes = ctypes.c_int, [ctypes.c_size_t]

    @property
    def available(self) -> bool:
        """glibc with mallinfo2 and malloc_trim (elsewhere: no samples, nothing trimmed)."""
        return self._mallinfo2 is not None and self._trim is not None

    @property
    def idle_poll_ms(self) -> int:
        """How long an idle worker waits on its inbox before a tick: a period; 0 (block until a message)
        when it never trims."""
        return max(1, int(self.period_s * 1000)) if self.available and self.period_s > 0 else 0

    def tick(self) -> HeapSample | None:
        if self.period_s <= 0 or not self.available or self.clock() - self._last < self.period_s:
            return None
        return self.sample_now()

    def sample_now(self) -> HeapSample:
        """Trim now and return what the heap holds after it."""
        if not self.available:
            raise RuntimeError("no glibc mallinfo2/malloc_trim in this process")
        before = _rss_bytes()
        self._trim(0)
        after = _rss_bytes()
        self.trims += 1
        self.released_bytes += max(0, before - after)
        info = self._mallinfo2()
        self._last = self.clock()
        return HeapSample(in_use=info.uordblks + info.hblkhd, free=info.fordblks, rss=after,
                          trims=self.trims, released=self.released_bytes)

"""KV slot allocator over the per-layer K/V pools (page size 1: one slot per token).

Slot 0 is reserved: the worker points padding at it, so it is never handed out.
"""
from __future__ import annotations


class KVAllocator:
    def __init__(self, size: int) -> None:
        self.size = size
        # Pop from the end: the lowest slots go out first, which keeps early traces readable.
        self._free: list[int] = list(range(size, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        return out

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def free_slots(self) -> list[int]:
        return list(self._free)

    def check_integrity(self) -> None:
        s = set(self._free)
        if len(s) != len(self._free):
            raise AssertionError("KV allocator: a slot is free twice")
        if s and (min(s) < 1 or max(s) > self.size):
            raise AssertionError("KV allocator: free slot out of range")

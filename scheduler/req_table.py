"""ReqToTokenPool: request rows; row r maps token position -> KV slot for the request in row r.

The worker keeps a device copy of the same table; the scheduler sends only the new entries.
"""
from __future__ import annotations

import numpy as np


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context: int) -> None:
        self.table = np.zeros((max_reqs, max_context), dtype=np.int64)
        self._free_rows: list[int] = list(range(max_reqs - 1, -1, -1))
        self.max_reqs = max_reqs

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        self.table[row, start : start + len(slots)] = slots

    def slots(self, row: int, start: int, end: int) -> list[int]:
        return self.table[row, start:end].tolist()

    def check_integrity(self, live_rows: set[int]) -> None:
        free = set(self._free_rows)
        if len(free) != len(self._free_rows):
            raise AssertionError("req table: a row is free twice")
        if free & live_rows:
            raise AssertionError("req table: a row is both free and live")
        if len(free) + len(live_rows) != self.max_reqs:
            raise AssertionError("req table: rows leaked")

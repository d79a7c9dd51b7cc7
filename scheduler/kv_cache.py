"""KV memory of requests: the slot allocator and the ReqToTokenPool behind one ownership API.

One release path (`release`) serves finish, abort and retraction.
"""
from __future__ import annotations

from scheduler.kv_allocator import KVAllocator
from scheduler.req import Req
from scheduler.req_table import ReqToTokenPool


class KVCacheManager:
    def __init__(self, num_slots: int, max_reqs: int, max_context: int) -> None:
        self.allocator = KVAllocator(num_slots)
        self.req_table = ReqToTokenPool(max_reqs, max_context)

    @property
    def num_free_slots(self) -> int:
        return self.allocator.num_free

    def assign_row(self, req: Req) -> bool:
        row = self.req_table.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        return True

    def grow(self, req: Req, n: int) -> list[int] | None:
        """Allocate KV for the next n tokens of req (positions kv_allocated_len ..); None if short."""
        slots = self.allocator.alloc(n)
        if slots is None:
            return None
        assert req.req_pool_idx is not None
        self.req_table.write(req.req_pool_idx, req.kv_allocated_len, slots)
        req.kv_allocated_len += n
        return slots

    def release(self, req: Req) -> int | None:
        """Free everything req owns; returns its row (the worker must drop it too), or None."""
        row = req.req_pool_idx
        if row is None:
            return None
        for start, end in (req.pop_committed_kv_cache(), req.pop_overallocated_kv_cache()):
            if end > start:
                self.allocator.free(self.req_table.slots(row, start, end))
        self.req_table.free(row)
        req.req_pool_idx = None
        req.kv_committed_len = req.kv_allocated_len = 0
        return row

    def check_integrity(self, live: list[Req]) -> None:
        """free + owned by requests == pool, with no slot in two places."""
        self.allocator.check_integrity()
        owned: list[int] = []
        rows: set[int] = set()
        for req in live:
            if req.req_pool_idx is None:
                if req.kv_allocated_len:
                    raise AssertionError(f"{req.rid} holds KV without a row")
                continue
            if not req.kv_committed_len <= req.kv_allocated_len:
                raise AssertionError(f"{req.rid}: committed {req.kv_committed_len} > allocated")
            rows.add(req.req_pool_idx)
            owned += self.req_table.slots(req.req_pool_idx, req.cache_protected_len, req.kv_allocated_len)
        free = self.allocator.free_slots()
        everything = owned + free
        if len(everything) != self.allocator.size or len(set(everything)) != len(everything):
            raise AssertionError(
                f"KV accounting broken: {len(free)} free + {len(owned)} owned != {self.allocator.size} "
                f"or a slot is in two places"
            )
        self.req_table.check_integrity(rows)

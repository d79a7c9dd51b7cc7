"""KV allocator over the per-layer K/V pools, in pages of `page_size` slots (1 = token granularity).

Page p holds slots p*P .. p*P+P-1. Page 0 is reserved: the worker points padding at slot 0, so it is
never handed out. Usable pages are 1..num_pages.
"""
from __future__ import annotations


class KVAllocator:
    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        # Pop from the end: the lowest pages go out first, which keeps traces readable.
        self._free: list[int] = list(range(self.num_pages, 0, -1))

    @property
    def size(self) -> int:
        """Usable slots."""
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        """Free slots."""
        return len(self._free) * self.page_size

    @property
    def room(self) -> int:
        """Slots a request can be given now (a HybridAllocator needs a sliding slot beside each)."""
        return self.num_free

    def alloc_pages(self, k: int) -> list[int] | None:
        """k pages, or None (nothing taken) if fewer are free."""
        if k > len(self._free):
            return None
        if k == 0:
            return []
        out = self._free[-k:]
        del self._free[-k:]
        return out

    def free_pages(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def alloc(self, n: int) -> list[int] | None:
        """n slots as n/page_size whole pages (n must be a multiple of the page size)."""
        if n % self.page_size:
            raise ValueError(f"alloc({n}) is not a whole number of {self.page_size}-slot pages")
        pages = self.alloc_pages(n // self.page_size)
        if pages is None:
            return None
        p = self.page_size
        return [pg * p + i for pg in pages for i in range(p)]

    def free(self, slots: list[int]) -> None:
        """Free the pages the slots lie in (each page once, however many of its slots are listed)."""
        if self.page_size == 1:
            self._free.extend(slots)
        else:
            p = self.page_size
            self._free.extend(dict.fromkeys(s // p for s in slots))

    def free_page_set(self) -> list[int]:
        return list(self._free)

    def free_slots(self) -> list[int]:
        p = self.page_size
        return [pg * p + i for pg in self._free for i in range(p)]

    def check_integrity(self) -> None:
        s = set(self._free)
        if len(s) != len(self._free):
            raise AssertionError("KV allocator: a page is free twice")
        if s and (min(s) < 1 or max(s) > self.num_pages):
            raise AssertionError("KV allocator: free page out of range")

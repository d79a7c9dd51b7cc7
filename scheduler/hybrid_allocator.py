"""The KV allocator of a model with sliding-window layers whose KV lives in a pool of their own.

The full-attention layers' pool is the one every request row and the prefix cache address (the allocator
this extends): a slot there is a token position of some request. The sliding-window layers keep their K/V
in a second, smaller pool; every full page handed out comes with a page of that pool (`swa_page`), and
the worker reads a sliding layer's slots through that map. A sliding page goes back on its own when every
sliding layer's window has moved past its positions (`free_window`: the full page stays, for the global
layers and the prefix cache), or together with its full page.

So the scheduler's token accounting is unchanged (rows, the tree and requests own full slots; the map says
which of them still have sliding-layer KV), and a long request holds sliding KV for its last window only.
"""
from __future__ import annotations

from collections.abc import Sequence

from tandem.scheduler.kv_allocator import KVAllocator


class HybridAllocator(KVAllocator):
    def __init__(self, num_slots: int, swa_slots: int, page_size: int = 1) -> None:
        super().__init__(num_slots, page_size)
        self.swa = KVAllocator(swa_slots, page_size)
        self.swa_page = [0] * (self.num_pages + 1)  # full page -> its sliding page (0: none, or freed)

    @property
    def room(self) -> int:
        """Slots a request can be given now: a full slot and a sliding one each."""
        return min(self.num_free, self.swa.num_free)

    def alloc_pages(self, k: int) -> list[int] | None:
        if k > min(len(self._free), len(self.swa._free)):
            return None
        pages, swa = super().alloc_pages(k), self.swa.alloc_pages(k)
        assert pages is not None and swa is not None
        for p, s in zip(pages, swa, strict=True):
            self.swa_page[p] = s
        return pages

    def free_pages(self, pages: list[int]) -> None:
        self._drop_swa(pages)
        super().free_pages(pages)

    def free(self, slots: list[int]) -> None:
        self._drop_swa(self._pages(slots))
        super().free(slots)

    def free_window(self, slots: Sequence[int]) -> None:
        """The sliding pages of these slots go back; their full pages stay with whoever owns them."""
        self._drop_swa(self._pages(slots))

    def _pages(self, slots: Sequence[int]) -> list[int]:
        p = self.page_size
        return list(slots) if p == 1 else list(dict.fromkeys(s // p for s in slots))

    def _drop_swa(self, pages: list[int]) -> None:
        swa = [self.swa_page[pg] for pg in pages if self.swa_page[pg]]
        for pg in pages:
            self.swa_page[pg] = 0
        self.swa.free_pages(swa)

    def has_swa(self, slot: int) -> bool:
        return self.swa_page[slot // self.page_size] != 0

    def swa_slots(self, slots: Sequence[int]) -> list[int]:
        """Each full slot's slot in the sliding pool (0, the padding slot, where it has none)."""
        p, m = self.page_size, self.swa_page
        if p == 1:
            return [m[s] for s in slots]
        return [m[s // p] * p + s % p if m[s // p] else 0 for s in slots]

    def window_ready(self, slots: Sequence[int], window: int) -> int:
        """The longest page-aligned prefix m of a cached run of slots (positions 0..) that a request can start
        computing after: positions m-window+1 .. m-1, what its first query reads, all have sliding KV."""
        m, p = len(slots), self.page_size
        while m > 0:
            missing = next(
                (i for i in range(m - 1, max(0, m - window + 1) - 1, -1) if not self.has_swa(slots[i])), None
            )
            if missing is None:
                return m
            m = missing // p * p  # a start at or before the gap does not read it
        return 0

    def check_integrity(self) -> None:
        super().check_integrity()
        self.swa.check_integrity()
        mapped = [s for s in self.swa_page if s]
        free_full = set(self._free)
        if len(set(mapped)) != len(mapped):
            raise AssertionError("KV allocator: a sliding page mapped twice")
        if set(mapped) & set(self.swa._free):
            raise AssertionError("KV allocator: a sliding page both mapped and free")
        if len(mapped) + len(self.swa._free) != self.swa.num_pages:
            raise AssertionError(f"KV allocator: sliding pages leaked: {len(mapped)} mapped + "
                                 f"{len(self.swa._free)} free of {self.swa.num_pages}")
        if any(self.swa_page[pg] for pg in free_full):
            raise AssertionError("KV allocator: a free page keeps a sliding page")

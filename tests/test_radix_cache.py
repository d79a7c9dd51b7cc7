"""Radix prefix cache: unit tests, plus a stateful model check against a dict of cached prefixes."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.scheduler.kv_allocator import KVAllocator
from tandem.scheduler.no_prefix_cache import NoPrefixCache
from tandem.scheduler.radix_cache import RadixCache
from tandem.scheduler.tree_node import TreeNode


def make(page_size: int = 1) -> tuple[RadixCache, list[list[int]]]:
    freed: list[list[int]] = []
    return RadixCache(lambda s: freed.append(list(s)), page_size), freed


# ---- unit tests ------------------------------------------------------------------------------
def test_match_on_empty_tree() -> None:
    cache, _ = make()
    res = cache.match_prefix([1, 2, 3])
    assert res.indices == [] and res.last_node is cache.root
    assert cache.match_prefix([]).indices == []


def test_insert_then_match_full_and_partial() -> None:
    cache, _ = make()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices == [10, 11, 12, 13]
    res = cache.match_prefix([1, 2, 9])
    assert res.indices == [10, 11] and res.last_node.key == [1, 2]  # split inside the edge
    assert [c.key for c in res.last_node.children.values()] == [[3, 4]]
    assert cache.match_prefix([2, 1]).indices == []
    assert cache.total_size() == 4 and sorted(cache.all_slots()) == [10, 11, 12, 13]
    cache.check_integrity()


def test_split_at_page_boundary() -> None:
    cache, _ = make(page_size=4)
    cache.insert(list(range(8)), list(range(100, 108)))
    res = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 99])  # diverges mid-page: round down to 4
    assert res.indices == [100, 101, 102, 103] and res.last_node.key == [0, 1, 2, 3]
    assert cache.insert([0, 1, 2, 3, 4, 5, 99, 99], list(range(200, 208))) == 4
    assert set(res.last_node.children) == {(4, 5, 6, 7), (4, 5, 99, 99)}
    cache.check_integrity()


def test_page16_truncation() -> None:
    cache, _ = make(page_size=16)
    key, slots = list(range(37)), list(range(1000, 1037))
    assert cache.insert(key, slots) == 0
    assert cache.total_size() == 32 and sorted(cache.all_slots()) == slots[:32]
    assert cache.match_prefix(key).indices == slots[:32]
    assert cache.match_prefix(key[:31]).indices == slots[:16]
    assert cache.match_prefix(key[:15]).indices == []
    assert cache.insert(key[:15], slots[:15]) == 0 and cache.total_size() == 32  # under a page: takes none


def test_insert_returns_already_cached_prefix() -> None:
    cache, _ = make()
    assert cache.insert([1, 2, 3], [10, 11, 12]) == 0
    assert cache.insert([1, 2, 3, 4, 5], [20, 21, 22, 23, 24]) == 3  # 20..22 are the caller's to free
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices == [10, 11, 12, 23, 24]
    assert cache.insert([1, 2], [30, 31]) == 2
    assert sorted(cache.all_slots()) == [10, 11, 12, 23, 24]
    with pytest.raises(ValueError):
        cache.insert([1, 2], [1])
    cache.check_integrity()


def test_evict_is_lru_among_unlocked_leaves() -> None:
    cache, freed = make()
    cache.insert([1, 1], [1, 2])
    cache.insert([2, 2], [3, 4])
    cache.insert([3, 3], [5, 6])
    cache.match_prefix([1, 1])  # [2, 2] is now the least recently used
    assert cache.evict(1) == 2 and freed == [[3, 4]]
    assert cache.evict(3) == 4 and freed == [[3, 4], [5, 6], [1, 2]]
    assert cache.total_size() == 0 and cache.evict(1) == 0
    cache.check_integrity()


def test_locked_nodes_are_never_evicted() -> None:
    cache, freed = make()
    cache.insert([1, 1], [1, 2])
    cache.insert([2, 2], [3, 4])
    node = cache.match_prefix([1, 1]).last_node
    cache.inc_lock_ref(node)
    assert cache.protected_size == 2 and cache.evictable_size == 2
    assert cache.evict(100) == 2 and freed == [[3, 4]]
    assert cache.match_prefix([1, 1]).indices == [1, 2]  # locked nodes still match
    cache.dec_lock_ref(node)
    assert cache.protected_size == 0 and cache.evict(1) == 2
    with pytest.raises(ValueError):
        cache.inc_lock_ref(node)  # evicted
    cache.check_integrity()


def test_evicting_a_leaf_exposes_its_parent() -> None:
    cache, freed = make()
    cache.insert([1, 2, 3, 4], [1, 2, 3, 4])
    cache.insert([1, 2, 5], [9, 9, 5])  # splits [1, 2]; [3, 4] keeps its older access time
    cache.insert([7], [7])
    assert cache.evict(1) == 2 and freed == [[3, 4]]  # [1, 2] still has the child [5]: not a leaf
    assert cache.evict(2) == 3 and freed[1:] == [[5], [1, 2]]  # then [1, 2] goes before the newer [7]
    cache.check_integrity()


def test_lock_survives_split() -> None:
    cache, _ = make(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.inc_lock_ref(node)
    cache.match_prefix([1, 2, 3, 4, 0, 0])  # splits the locked node: both halves stay locked
    assert node.parent is not None and node.parent.lock_ref == 1 and cache.protected_size == 6
    cache.check_integrity()
    cache.dec_lock_ref(node)
    assert cache.protected_size == 0 and cache.evictable_size == 6
    cache.check_integrity()


def test_no_prefix_cache() -> None:
    cache = NoPrefixCache()
    assert cache.insert([1, 2, 3], [1, 2, 3]) == 3  # takes nothing: the caller keeps (and frees) every slot
    res = cache.match_prefix([1, 2, 3])
    assert res.indices == [] and res.last_node is cache.root and res.host_hit_length == 0
    cache.inc_lock_ref(res.last_node)
    cache.dec_lock_ref(res.last_node)
    assert cache.evictable_size == 0 and cache.evict(10) == 0 and cache.all_slots() == []
    assert cache.take_copies() is None
    with pytest.raises(ValueError):
        cache.inc_lock_ref(object())
    cache.check_integrity()


def test_reset_frees_everything() -> None:
    cache, freed = make()
    cache.insert([1, 2], [1, 2])
    cache.insert([1, 3], [5, 6])
    node = cache.match_prefix([1, 2]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert sorted(sum(freed, [])) == [1, 2, 6] and cache.total_size() == 0
    assert cache.match_prefix([1, 2]).indices == []


def _corrupt_dup(c: RadixCache) -> None:
    c.root.children[1].children[2].value[0] = c.root.children[1].value[0]


@pytest.mark.parametrize("corrupt", [
    _corrupt_dup,
    lambda c: c.root.children[1].children[2].key.__setitem__(0, 9),  # edge's first page mismatch
    lambda c: c.root.children[1].value.append(99),  # len(key) != len(value)
    lambda c: setattr(c.root.children[1].children[2], "key", []),
    lambda c: setattr(c.root.children[1].children[2], "lock_ref", -1),
    lambda c: setattr(c.root.children[1].children[2], "lock_ref", 1),  # child locked more than parent
    lambda c: setattr(c, "_evictable", 1),
    lambda c: setattr(c, "_protected", 1),
    lambda c: setattr(c.root.children[1], "host_value", [7]),  # a host copy without a host tier
])
def test_check_integrity_catches_corruption(corrupt) -> None:
    cache, _ = make()
    cache.insert([1, 2], [1, 2])
    cache.insert([1, 3], [3, 4])
    cache.check_integrity()
    corrupt(cache)
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_check_integrity_catches_unaligned_edge() -> None:
    cache, _ = make(page_size=2)
    cache.insert([1, 2, 3, 4], [1, 2, 3, 4])
    cache.root.children[(1, 2)].key = [1, 2, 3]
    cache.root.children[(1, 2)].value = [1, 2, 3]
    with pytest.raises(AssertionError, match="page-aligned"):
        cache.check_integrity()


def test_long_key_split() -> None:
    cache, _ = make(page_size=16)
    key = list(range(2000))
    cache.insert(key, list(range(1, 2001)))
    assert cache.match_prefix(key).indices == list(range(1, 2001))
    cache.match_prefix(key[:1000] + [0] * 1000)  # mismatch at 1000: a split
    cache.check_integrity()


# ---- stateful model check --------------------------------------------------------------------
PAGES16 = ([0] * 16, [1] * 16, [0] * 8 + [1] * 8, [2] * 16)  # the third shares half a page with the first
units_st = st.lists(st.integers(0, 3), max_size=8)
tail_st = st.integers(0, 15)


@dataclass
class Held:  # a running request: a locked matched prefix plus slots it allocated itself
    key: list[int]
    prefix_len: int
    slots: list[int]
    node: TreeNode


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    pool = 40

    def __init__(self) -> None:
        super().__init__()
        self.alloc = KVAllocator(self.pool)
        self.freed: list[list[int]] = []
        self.cache = RadixCache(self._free, self.page_size)
        self.ref: dict[tuple[int, ...], list[int]] = {}  # every cached page-aligned prefix -> its slots
        self.atime: dict[tuple[int, ...], int] = {}  # prefix -> last access of its last page
        self.clock = 0
        self.held: list[Held] = []

    def _free(self, slots: list[int]) -> None:
        self.freed.append(list(slots))
        self.alloc.free(slots)

    def _key(self, units: list[int], tail: int) -> list[int]:
        if self.page_size == 1:
            return units
        return [t for u in units for t in PAGES16[u]] + list(range(tail))

    def _longest(self, key: list[int]) -> int:
        ps, m = self.page_size, 0
        while m + ps <= len(key) and tuple(key[: m + ps]) in self.ref:
            m += ps
        return m

    def _touch(self, key: list[int], upto: int) -> None:
        for k in range(self.page_size, upto + 1, self.page_size):
            self.atime[tuple(key[:k])] = self.clock

    def _match(self, key: list[int]):
        m = self._longest(key)
        res = self.cache.match_prefix(key)
        self.clock += 1
        self._touch(key, m)
        assert len(res.indices) == m and res.indices == self.ref.get(tuple(key[:m]), [])
        path, node = [], res.last_node
        while node.parent is not None:
            path[:0], node = node.key, node.parent
        assert node is self.cache.root and path == key[:m]
        return res

    def _insert(self, key: list[int], slots: list[int]) -> int:
        m, n = self._longest(key), len(key) // self.page_size * self.page_size
        got = self.cache.insert(key, slots)
        self.clock += 1
        assert got == m
        for k in range(m + self.page_size, n + 1, self.page_size):
            self.ref[tuple(key[:k])] = self.ref.get(tuple(key[:m]), []) + slots[m:k]
        self._touch(key, n)
        self.alloc.free(slots[n:])  # the unaligned tail never enters the tree
        return got

    def _locked(self) -> set[tuple[int, ...]]:
        ps = self.page_size
        return {tuple(h.key[:k]) for h in self.held for k in range(ps, h.prefix_len + 1, ps)}

    def _alloc(self, n: int) -> list[int] | None:
        if n > self.alloc.num_free:  # like the scheduler: make room from the cache first
            self._evict(n - self.alloc.num_free)
        return self.alloc.alloc(n)

    def _evict(self, num: int) -> None:
        ps, before, times, locked = self.page_size, dict(self.ref), dict(self.atime), self._locked()
        self.freed.clear()
        got = self.cache.evict(num)
        kept = self._tree()[0]
        for p in before.keys() - kept.keys():
            del self.ref[p], self.atime[p]
        removed = before.keys() - self.ref.keys()
        assert not removed & locked
        assert all(q not in self.ref for p in removed for q in before if q[: len(p)] == p)  # leaves first
        assert got == len(removed) * ps
        assert sorted(s for c in self.freed for s in c) == sorted(s for p in removed for s in before[p][-ps:])
        if got < num:
            assert self.cache.evictable_size == 0
        elif got:
            assert got - len(self.freed[-1]) < num  # stops as soon as enough is freed
        leaves = [p for p in self.ref if p not in locked
                  and not any(len(q) == len(p) + ps and q[: len(p)] == p for q in self.ref)]
        if removed and leaves:  # LRU: nothing evicted was newer than an unlocked leaf that stayed
            assert max(times[p] for p in removed) <= min(self.atime[p] for p in leaves)

    def _tree(self) -> tuple[dict[tuple[int, ...], list[int]], dict[tuple[int, ...], int]]:
        slots, times = {}, {}
        stack = [((), self.cache.root, [])]
        while stack:
            prefix, node, acc = stack.pop()
            for c in node.children.values():
                for k in range(self.page_size, len(c.key) + 1, self.page_size):
                    slots[prefix + tuple(c.key[:k])] = acc + c.value[:k]
                    times[prefix + tuple(c.key[:k])] = c.last_access
                stack.append((prefix + tuple(c.key), c, acc + c.value))
        return slots, times

    @rule(units=units_st, tail=tail_st)
    def match(self, units: list[int], tail: int) -> None:
        self._match(self._key(units, tail))

    @rule(units=units_st, tail=tail_st)
    def insert_fresh(self, units: list[int], tail: int) -> None:
        key = self._key(units, tail)
        slots = self._alloc(len(key))
        if slots is not None:
            got = self._insert(key, slots)
            self.alloc.free(slots[:got])  # duplicates of what the tree already had

    @rule(units=units_st, tail=tail_st)
    def start_request(self, units: list[int], tail: int) -> None:
        key = self._key(units, tail)
        res = self._match(key)
        self.cache.inc_lock_ref(res.last_node)
        new = self._alloc(len(key) - len(res.indices))
        if new is None:
            self.cache.dec_lock_ref(res.last_node)
        else:
            self.held.append(Held(key, len(res.indices), res.indices + new, res.last_node))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 7))
    def finish_request(self, i: int) -> None:
        h = self.held.pop(i % len(self.held))
        got = self._insert(h.key, h.slots)
        assert got >= h.prefix_len  # its locked prefix is still cached
        self.alloc.free(h.slots[h.prefix_len : got])  # computed by it, but someone cached them first
        self.cache.dec_lock_ref(h.node)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 7))
    def abort_request(self, i: int) -> None:
        h = self.held.pop(i % len(self.held))
        self.alloc.free(h.slots[h.prefix_len :])
        self.cache.dec_lock_ref(h.node)

    @rule(frac=st.integers(0, 4))
    def evict(self, frac: int) -> None:
        self._evict(self.pool * frac // 8)

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity()
        self.alloc.check_integrity()
        assert self._tree() == (self.ref, self.atime)
        ps, locked = self.page_size, self._locked()
        assert self.cache.total_size() == len(self.ref) * ps
        assert self.cache.protected_size == len(locked) * ps
        tree = self.cache.all_slots()
        assert sorted(tree) == sorted(s for p in self.ref for s in self.ref[p][-ps:])
        mine = [s for h in self.held for s in h.slots[h.prefix_len :]]
        everything = self.alloc.free_slots() + tree + mine
        assert sorted(everything) == list(range(1, self.pool + 1))


class RadixMachine16(RadixMachine):
    page_size = 16
    pool = 320


_settings = settings(max_examples=120, stateful_step_count=40, deadline=None, database=None)
TestRadixPage1 = RadixMachine.TestCase
TestRadixPage1.settings = _settings
TestRadixPage16 = RadixMachine16.TestCase
TestRadixPage16.settings = _settings

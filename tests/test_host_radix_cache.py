"""The host tier's accounting, on the tree alone: evict to host, match across tiers, load back, evict from
host, write-through, and the copies each of them queues for the worker."""
from __future__ import annotations

import random

import pytest

from tandem.scheduler.host_tier import WriteBack, WriteThrough
from tandem.scheduler.kv_allocator import KVAllocator
from tandem.scheduler.radix_cache import RadixCache


class Pools:
    """A device allocator and a host allocator, with the tree between them."""

    def __init__(self, device: int = 64, host: int = 64, page: int = 1, write_through: bool = False) -> None:
        self.dev = KVAllocator(device, page)
        self.host = KVAllocator(host, page)
        self.cache = RadixCache(
            self.dev.free, page, (WriteThrough if write_through else WriteBack)(self.host)
        )

    def cache_seq(self, key: list[int]) -> list[int]:
        """Compute key from scratch (fresh device slots) and cache it, like a finished request does."""
        slots = self.dev.alloc(len(key))
        assert slots is not None
        already = self.cache.insert(key, slots)
        self.dev.free(slots[:already])
        return slots

    def check(self) -> None:
        self.cache.check_integrity()
        tree = set(self.cache.all_slots())
        free = set(self.dev.free_slots())
        assert not tree & free and len(tree) + len(free) == self.dev.size, "device slots leaked or doubled"


def test_evict_to_host_then_match_across_tiers_and_load_back() -> None:
    p = Pools()
    a = p.cache_seq([1, 2, 3, 4, 5, 6])
    p.cache.match_prefix([1, 2, 3, 9])  # split after 3: [1 2 3] is newer than [4 5 6]
    assert p.cache.evict(3) == 3  # the LRU leaf [4 5 6] leaves the device...
    copies = p.cache.take_copies()
    assert copies is not None and copies.to_host_src == a[3:] and not copies.to_device_src
    assert p.cache.host_used == 3 and p.cache.evictable_size == 3 and p.dev.num_free == 64 - 3
    assert p.cache.take_copies() is None  # handed over once
    p.check()

    m = p.cache.match_prefix([1, 2, 3, 4, 5, 6, 7])  # ...and is still matched, in the host tier
    assert m.indices == a[:3] and m.host_hit_length == 3 and m.last_host_node is not m.last_node
    host_slots = list(m.last_host_node.host_value)
    assert host_slots == copies.to_host_dst
    p.cache.inc_lock_ref(m.last_host_node)
    new = p.dev.alloc(3)
    assert new is not None
    assert p.cache.load_back(m, new) == a[:3] + new
    c = p.cache.take_copies()
    assert c is not None and c.to_device_src == host_slots and c.to_device_dst == new and not c.to_host_src
    assert p.cache.protected_size == 6 and p.cache.host_used == 3  # the host copy stays: re-eviction is free
    p.check()
    p.cache.dec_lock_ref(m.last_host_node)
    assert p.cache.evict(6) == 6 and p.cache.take_copies() is not None  # [1 2 3] had no host copy yet
    assert p.cache.host_used == 6 and p.cache.evictable_size == 0
    m = p.cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.indices == [] and m.host_hit_length == 6 and m.last_node is p.cache.root
    p.check()


def test_locked_path_is_never_evicted_from_either_tier() -> None:
    p = Pools(device=16, host=4)
    p.cache_seq([1, 2, 3, 4])
    p.cache.evict(4)
    m = p.cache.match_prefix([1, 2, 3, 4])
    p.cache.inc_lock_ref(m.last_host_node)  # a request matched the host copy and waits for its load
    p.cache_seq([7, 7, 7, 7])
    p.cache_seq([7, 7, 7, 7, 8, 8])
    assert p.cache.evict(6) == 6  # the host is full of the locked node: [7 ...] can't go there...
    assert p.cache.match_prefix([1, 2, 3, 4]).host_hit_length == 4  # ...and the locked node stays
    m7 = p.cache.match_prefix([7, 7, 7, 7, 8, 8])
    assert m7.indices == [] and m7.host_hit_length == 0  # [7 ...] and its subtree left the tree
    assert p.dev.num_free == 16 and p.cache.host_used == 4
    p.check()
    p.cache.dec_lock_ref(m.last_host_node)


def test_host_eviction_is_lru_and_takes_host_only_leaves_out() -> None:
    p = Pools(device=32, host=8)
    ones = sorted(p.cache_seq([1] * 4))
    for k in (2, 3):
        p.cache_seq([k] * 4)
    p.cache.match_prefix([1] * 4)  # [1...] is now the most recently used
    assert p.cache.evict(12) == 12
    # The host holds 8: [2...] went first (LRU), then [3...]; [1...] displaced [2...] from the host.
    assert p.cache.match_prefix([1] * 4).host_hit_length == 4
    assert p.cache.match_prefix([3] * 4).host_hit_length == 4
    assert p.cache.match_prefix([2] * 4).host_hit_length == 0
    c = p.cache.take_copies()
    # [2...]'s copy was queued, then its host slots went to [1...]: only the last write of a slot is sent.
    assert c is not None and len(c.to_host_src) == len(set(c.to_host_dst)) == 8
    one = p.cache.match_prefix([1] * 4).last_host_node.host_value
    assert sorted(s for s, h in zip(c.to_host_src, c.to_host_dst) if h in one) == ones
    assert p.cache.host_used == 8
    p.check()


def test_insert_over_host_only_nodes_brings_them_back() -> None:
    p = Pools()
    p.cache_seq([1, 2, 3, 4])
    p.cache.evict(4)
    slots = p.dev.alloc(6)
    assert slots is not None
    assert p.cache.insert([1, 2, 3, 4, 5, 6], slots) == 0  # nothing was on the device: the tree takes all
    m = p.cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.indices == slots and m.host_hit_length == 0
    assert p.cache.host_used == 4  # the revived node keeps its host copy
    p.check()


def test_write_through_backs_up_at_insert_and_evicts_without_copies() -> None:
    p = Pools(write_through=True)
    a = p.cache_seq([1, 2, 3, 4])
    c = p.cache.take_copies()
    assert c is not None and c.to_host_src == a and p.cache.host_used == 4
    assert p.cache.evict(4) == 4 and p.cache.take_copies() is None  # the copy was made already
    assert p.cache.match_prefix([1, 2, 3, 4]).host_hit_length == 4
    p.check()


@pytest.mark.parametrize("page", [1, 4])
def test_split_keeps_both_tiers_aligned(page: int) -> None:
    p = Pools(page=page, write_through=True)
    key = list(range(1, 17))
    slots = p.cache_seq(key)
    host = list(p.cache.match_prefix(key).last_node.host_value)
    m = p.cache.match_prefix(key[:8] + [99] * 8)  # splits the node after 8 tokens, in both tiers
    assert m.indices == slots[:8] and list(m.last_node.host_value) == host[:8]
    p.check()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page", [1, 2])
@pytest.mark.parametrize("write_through", [False, True])
def test_random_operations_keep_both_tiers_consistent(seed: int, page: int, write_through: bool) -> None:
    """Random inserts, matches with loads, locks and evictions: the tree's view of every cached prefix is
    what was cached (device slots hold it, or the host copy made from them), and no slot leaks."""
    rng = random.Random(seed)
    p = Pools(device=48, host=96, page=page, write_through=write_through)
    content: dict[int, tuple[int, ...]] = {}  # device slot -> the prefix its KV is for
    host_content: dict[int, tuple[int, ...]] = {}
    locked: list = []

    def apply_copies() -> None:
        c = p.cache.take_copies()
        if c is not None:
            for d, h in zip(c.to_host_src, c.to_host_dst):
                host_content[h] = content[d]
            for h, d in zip(c.to_device_src, c.to_device_dst):
                content[d] = host_content[h]

    for _ in range(150):
        key = [rng.randrange(1, 4) for _ in range(rng.randrange(page, 12))]
        op = rng.random()
        if op < 0.4:
            m = p.cache.match_prefix(key)
            for i, s in enumerate(m.indices):
                assert content[s] == tuple(key[: i + 1]), "a matched slot holds another prefix's KV"
            p.cache.inc_lock_ref(m.last_host_node)
            n = m.host_hit_length
            if n and p.dev.num_free + p.cache.evictable_size >= n:
                p.cache.evict(n - p.dev.num_free)
                apply_copies()
                got = p.cache.load_back(m, p.dev.alloc(n) or [])
                apply_copies()
                for i, s in enumerate(got):
                    assert content[s] == tuple(key[: i + 1]), "a loaded slot holds another prefix's KV"
            locked.append(m.last_host_node)
        elif op < 0.75:
            aligned = len(key) // page * page
            p.cache.evict(aligned - p.dev.num_free)
            apply_copies()
            slots = p.dev.alloc(aligned)
            if slots is None:
                continue
            for i, s in enumerate(slots):
                content[s] = tuple(key[: i + 1])
            already = p.cache.insert(key[:aligned], slots)
            apply_copies()
            p.dev.free(slots[:already])
        elif locked and op < 0.9:
            p.cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            p.cache.evict(rng.randrange(1, 16))
            apply_copies()
        p.check()
    for node in locked:
        p.cache.dec_lock_ref(node)
    assert p.cache.protected_size == 0
    p.check()

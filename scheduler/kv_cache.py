"""KV memory of requests: the page allocator, the ReqToTokenPool and the prefix cache behind one
ownership API. A request owns row positions [cache_protected_len, kv_allocated_len); the tree owns
the prefix before that (locked while the request runs). One release path (`release`) serves finish,
abort and retraction. With a host tier, the part of a match found only there is copied back to device
slots the tree owns (`load_host`) before the request's first step.

A model whose sliding-window layers have a KV pool of their own (`window` > 0, scheduler/hybrid_allocator.py)
gives back, as each request grows, the sliding KV of its own positions that every window has left behind
(`release_window`); a prefix match is cut back to where the positions its first computed query reads
still have sliding KV.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.protocol.messages import KVCopies
from tandem.scheduler.host_tier import POLICIES
from tandem.scheduler.hybrid_allocator import HybridAllocator
from tandem.scheduler.kv_allocator import KVAllocator
from tandem.scheduler.no_prefix_cache import NoPrefixCache
from tandem.scheduler.prefix_cache import PrefixHandle
from tandem.scheduler.radix_cache import RadixCache
from tandem.scheduler.req import Req
from tandem.scheduler.req_table import ReqToTokenPool
from tandem.scheduler.tree_node import TreeNode


@dataclass(frozen=True)
class Hold:
    """A session turn's KV, locked in the prefix cache (`KVCacheManager.hold`). With a host tier it is kept
    there (host=True): its device copy may be evicted like any cache and is loaded back when the session
    continues; without one (or with the host pool full) it is pinned on the device."""

    node: TreeNode
    host: bool


class KVCacheManager:
    def __init__(
        self, num_slots: int, max_reqs: int, max_context: int, page_size: int = 1, prefix_cache: bool = True,
        host_slots: int = 0, host_policy: str = "write_back", window: int = 0, swa_slots: int = 0,
    ) -> None:
        """window, swa_slots: the sliding-window layers' window and the slots of their own pool (swa_slots 0:
        no such pool; then sliding layers, if any, read the full slots and nothing is given back)."""
        if swa_slots and (not window or host_slots):
            raise ValueError("a sliding-window pool needs its window, and no host tier")
        self.window = window if swa_slots else 0
        self.hybrid = HybridAllocator(num_slots, swa_slots, page_size) if swa_slots else None
        self.allocator = self.hybrid or KVAllocator(num_slots, page_size)
        self.req_table = ReqToTokenPool(max_reqs, max_context)
        self.tree: RadixCache | NoPrefixCache
        if not prefix_cache:
            self.tree = NoPrefixCache(page_size)
        else:
            host = POLICIES[host_policy](KVAllocator(host_slots, page_size)) if host_slots else None
            self.tree = RadixCache(self.allocator.free, page_size, host)
        self.page_size = page_size
        self.host_hit_tokens = 0  # prompt tokens whose KV was copied back from the host tier

    @property
    def num_free_slots(self) -> int:
        return self.allocator.num_free

    @property
    def available_slots(self) -> int:
        """Free now, or freeable by evicting unlocked cache (full slots: a sliding pool short of them shows in
        ensure_free)."""
        return self.allocator.num_free + self.tree.evictable_size

    # ---- admission ----------------------------------------------------------------------------
    def assign_row(self, req: Req) -> bool:
        row = self.req_table.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        return True

    def match_prefix(self, req: Req, limit: int | None = None, held: Hold | None = None) -> PrefixHandle:
        """Attach the longest cached prefix of req's first `limit` tokens (always leaving one token to
        compute), both tiers, and lock it. The host part (host_hit_length tokens) counts as computed but
        has no device slots until `load_host`. held: a session turn's KV (see `hold`), taken as it is,
        unmatched, when it fits the limit."""
        fill = req.key_ids
        n = len(fill) - 1 if limit is None else min(limit, len(fill) - 1)
        m = self.tree.prefix_at(held.node) if held is not None else None
        if m is None or m.length > n:
            m = self.tree.match_prefix(fill[:n])
            req.prefix_source = "host" if m.host_hit_length else "device" if m.length else "none"
        else:
            req.prefix_source = "session"
        if self.hybrid is not None and m.indices:  # start where the window before the start is held
            ready = self.hybrid.window_ready(m.indices, self.window)
            if ready < len(m.indices):
                m = self.tree.match_prefix(fill[:ready])
                req.prefix_source = "device" if m.length else "none"
        self._hold(req, m)
        req.kv_committed_len = req.kv_allocated_len = req.num_computed_tokens = m.length
        assert req.req_pool_idx is not None
        self.req_table.write(req.req_pool_idx, 0, m.indices)
        return m

    def load_host(self, req: Req) -> PrefixHandle:
        """Device slots for the host part of req's match, filled by a host -> device copy that the next
        step carries; returns req's prefix, all on the device now. The caller made the slots free
        (`ensure_free`)."""
        m = req.prefix
        if m is None or req.req_pool_idx is None:
            raise RuntimeError(f"{req.rid}: load_host before match_prefix")
        n = m.host_hit_length
        if not n:
            return m
        slots = self.allocator.alloc(n)
        if slots is None:
            raise RuntimeError(f"{req.rid}: no device slots to load {n} host-tier tokens into")
        req.prefix = PrefixHandle(self.tree.load_back(m, slots), m.last_host_node, m.last_host_node, 0)
        self.req_table.write(req.req_pool_idx, len(m.indices), slots)
        self.host_hit_tokens += n
        return req.prefix

    def unmatch_prefix(self, req: Req) -> None:
        """Undo match_prefix for a request that could not be admitted after all."""
        self._hold(req, None)
        req.kv_committed_len = req.kv_allocated_len = req.num_computed_tokens = 0

    def _hold(self, req: Req, prefix: PrefixHandle | None) -> None:
        """Move req's lock on the cache to prefix (None: let go), locking the new one first."""
        if prefix is not None:
            self.tree.inc_lock_ref(prefix.last_host_node)
        if req.prefix is not None:
            self.tree.dec_lock_ref(req.prefix.last_host_node)
        req.prefix = prefix

    # ---- holds: a session turn's KV, locked until the session lets it go ------------------------------
    def hold(self, key: list[int]) -> Hold | None:
        """Lock the cached prefix of key (a finished request's, just cached by `release`) for a session
        turn, in the host tier if it can take it, else on the device; None when nothing of it is cached."""
        m = self.tree.match_prefix(key)
        if not m.indices:
            return None
        self.tree.inc_lock_ref(m.last_node)  # while it is copied: the host tier must not drop the copies made
        if isinstance(self.tree, RadixCache) and self.tree.back_up(m.last_node):
            self.tree.inc_host_lock(m.last_node)
            self.tree.dec_lock_ref(m.last_node)
            return Hold(m.last_node, True)
        return Hold(m.last_node, False)

    def unhold(self, h: Hold) -> None:
        (self.tree.dec_host_lock if h.host else self.tree.dec_lock_ref)(h.node)  # type: ignore[union-attr]

    # ---- growth -------------------------------------------------------------------------------
    def pages_needed(self, req: Req, n: int) -> int:
        p = self.page_size
        room = (-req.kv_allocated_len) % p  # free slots left in the request's last page
        return max(0, -(-(n - room) // p))

    def ensure_free(self, slots_needed: int) -> bool:
        """Evict unlocked cache until slots_needed slots are free; False if even that is not enough."""
        # A hybrid allocator's room may stay short after an eviction that freed enough full slots (their
        # sliding KV was given back already): evict on while it frees anything.
        while self.allocator.room < slots_needed and self.tree.evict(slots_needed - self.allocator.room):
            pass
        return self.allocator.room >= slots_needed

    def grow(self, req: Req, n: int) -> list[int] | None:
        """KV slots for req's next n positions (from kv_allocated_len), evicting cache if needed; None if
        short."""
        p = self.page_size
        k = self.pages_needed(req, n)
        if not self.ensure_free(k * p):
            return None
        pages = self.allocator.alloc_pages(k)
        assert pages is not None and req.req_pool_idx is not None
        start = req.kv_allocated_len
        slots: list[int] = []
        if start % p:  # continue in the last page
            last = int(self.req_table.table[req.req_pool_idx, start - 1])
            take = min(n, p - start % p)
            slots = list(range(last + 1, last + 1 + take))
        for pg in pages:
            slots.extend(range(pg * p, pg * p + p))
        slots = slots[:n]
        self.req_table.write(req.req_pool_idx, start, slots)
        req.kv_allocated_len += n
        return slots

    def shrink(self, req: Req, n: int) -> None:
        """Give back the last n positions of req's allocation (rejected draft tokens). Pages are freed
        whole: a partly used last page stays with the request, and grow() continues in it."""
        assert req.req_pool_idx is not None and req.kv_allocated_len - n >= req.kv_committed_len
        old = req.kv_allocated_len
        req.kv_allocated_len -= n
        keep = -(-req.kv_allocated_len // self.page_size) * self.page_size
        if old > keep:
            self.allocator.free(self.req_table.slots(req.req_pool_idx, keep, old))

    def release_window(self, req: Req) -> None:
        """Give back the sliding KV of req's own positions that no query of it will read again: its next
        query sits at kv_committed_len or later (steps in flight compute positions after the committed ones)
        and reads keys from kv_committed_len - window + 1 on. Whole pages only, and counted from the last
        whole page, where the cache would take the request (so a request continuing it finds the window
        before it held); positions the tree owns stay (another request may start after them)."""
        if self.hybrid is None or req.req_pool_idx is None:
            return
        p = self.page_size
        end = (req.kv_committed_len // p * p - self.window + 1) // p * p
        start = max(req.swa_released_len, req.cache_protected_len)
        if end > start:
            self.hybrid.free_window(self.req_table.slots(req.req_pool_idx, start, end))
            req.swa_released_len = end

    def after_commit(self, req: Req, prefill: bool) -> None:
        """A step of req's was committed (it runs on): the sliding KV its windows passed goes back, and a
        prefill chunk is cached."""
        self.release_window(req)
        if prefill:
            self.cache_unfinished(req)  # others can reuse it while this one runs

    def swa_slots(self, slots: list[int]) -> list[int]:
        """The sliding pool's slot of each full slot (the worker maps a sliding layer's reads and writes)."""
        return [] if self.hybrid is None else self.hybrid.swa_slots(slots)

    # ---- caching and release -----------------------------------------------------------------------
    def cache_unfinished(self, req: Req) -> None:
        """Chunked prefill inserts as it goes: hand the committed, page-aligned prefix to the tree.

        Done only when the tree holds nothing beyond what req already locks, so no slot of req's row
        changes owner mid-flight (the worker's copy of the row stays valid). Not with a sliding-window pool:
        the tree would own the chunks' sliding KV, which no request can then give back while it runs, so a
        long prompt would hold all of it; the prefix is cached when the request ends."""
        if req.req_pool_idx is None or self.hybrid is not None:
            return
        aligned = req.kv_committed_len // self.page_size * self.page_size
        if aligned <= req.cache_protected_len:
            return
        key = req.key_ids[:aligned]
        if len(self.tree.match_prefix(key).indices) != req.cache_protected_len:
            return  # another request cached more of this prefix meanwhile: settle at finish
        row = req.req_pool_idx
        if self.tree.insert(key, self.req_table.slots(row, 0, aligned)) != req.cache_protected_len:
            return  # the cache took nothing (no prefix cache)
        self._hold(req, self.tree.match_prefix(key))  # all of key, on the device: protected becomes `aligned`

    def release(self, req: Req) -> int | None:
        """Free everything req owns, caching its committed prefix; returns its row (the worker drops it)."""
        row = req.req_pool_idx
        if row is None:
            return None
        protected, committed = req.pop_committed_kv_cache()
        _, allocated = req.pop_overallocated_kv_cache()
        p = self.page_size
        aligned = committed // p * p
        to_free: list[int] = []
        if aligned > protected:
            slots = self.req_table.slots(row, 0, aligned)
            already = self.tree.insert(req.key_ids[:aligned], slots)
            to_free += slots[protected:already]  # computed here but cached by another request first
        else:
            aligned = protected
        if allocated > aligned:
            to_free += self.req_table.slots(row, aligned, allocated)
        if to_free:
            self.allocator.free(to_free)
        self._hold(req, None)
        self.req_table.free(row)
        req.req_pool_idx = None
        req.kv_committed_len = req.kv_allocated_len = req.swa_released_len = 0
        return row

    def take_copies(self) -> KVCopies | None:
        return self.tree.take_copies()

    def check_idle(self, holds: Sequence[Hold] = ()) -> None:
        """Cheap enough for every time the engine goes idle (the full check walks every page in Python):
        the tree's own check over both tiers, nothing owned outside the tree and the free lists, and
        nothing locked but what the sessions hold (`holds`)."""
        self.tree.check_integrity()
        free, tree = self.allocator.num_free, self.tree.evictable_size + self.tree.protected_size
        if self.tree.protected_size != self.locked_size(holds) or free + tree != self.allocator.size:
            raise AssertionError(f"idle KV: {free} free + {tree} cached "
                                 f"({self.tree.protected_size} locked) of {self.allocator.size}")
        if self.req_table.num_free != self.req_table.max_reqs:
            raise AssertionError(
                f"idle: {self.req_table.max_reqs - self.req_table.num_free} request rows held"
            )

    # ---- invariants ------------------------------------------------------------------------------
    def locked_size(self, holds: Sequence[Hold]) -> int:
        """Device tokens the holds pin there (each node once)."""
        return sum(n.device_len for n in _paths([h.node for h in holds if not h.host], self.tree.root))

    def check_integrity(self, live: list[Req], holds: Sequence[Hold] = ()) -> None:
        """free + tree-owned + request-owned == pool (in pages), with no page in two places; every lock in
        the tree is a live request's prefix or a session's hold (`holds`), and the other way round."""
        self.allocator.check_integrity()
        self.tree.check_integrity()
        locks = [r.prefix.last_host_node for r in live if r.prefix is not None] + [
            h.node for h in holds if not h.host
        ]
        want, want_host = (
            _paths(locks, self.tree.root),
            _paths([h.node for h in holds if h.host], self.tree.root),
        )
        for n in self.tree.nodes():
            if (n.lock_ref, n.host_lock_ref) != (want.get(n, 0), want_host.get(n, 0)):
                raise AssertionError(
                    f"locks: {n} has lock_ref {n.lock_ref} and host_lock_ref {n.host_lock_ref}, "
                    f"its holders {want.get(n, 0)} and {want_host.get(n, 0)} (requests, sessions)"
                )
        p = self.page_size
        owners: dict[int, str] = {}

        def claim(pages: list[int], who: str) -> None:
            for pg in pages:
                if pg in owners:
                    raise AssertionError(f"KV page {pg} owned by {owners[pg]} and {who}")
                owners[pg] = who

        claim(self.allocator.free_page_set(), "free list")
        claim(list(dict.fromkeys(s // p for s in self.tree.all_slots())), "tree")
        rows: set[int] = set()
        for req in live:
            if req.req_pool_idx is None:
                if req.kv_allocated_len or req.prefix is not None:
                    raise AssertionError(f"{req.rid} holds KV or a lock without a row")
                continue
            if not req.cache_protected_len <= req.kv_committed_len <= req.kv_allocated_len:
                raise AssertionError(f"{req.rid}: KV counters out of order {req!r}")
            rows.add(req.req_pool_idx)
            own = self.req_table.slots(req.req_pool_idx, req.cache_protected_len, req.kv_allocated_len)
            claim(list(dict.fromkeys(s // p for s in own)), req.rid)
            if self.hybrid is not None:  # sliding KV given back below swa_released_len, kept above
                cut = max(0, min(len(own), req.swa_released_len - req.cache_protected_len))
                if any(self.hybrid.has_swa(s) for s in own[:cut]) or not all(
                    map(self.hybrid.has_swa, own[cut:])
                ):
                    raise AssertionError(f"{req.rid}: sliding KV held below or missing above position "
                                         f"{req.swa_released_len}")
        if len(owners) != self.allocator.num_pages:
            raise AssertionError(f"KV pages leaked: {len(owners)} accounted of {self.allocator.num_pages}")
        self.req_table.check_integrity(rows)


def _paths(nodes: Sequence[TreeNode], root: TreeNode) -> dict[TreeNode, int]:
    """How many of nodes each node is, or is an ancestor of (the root aside): the lock_ref they make."""
    count: dict[TreeNode, int] = {}
    for node in nodes:
        n: TreeNode | None = node
        while n is not root:
            if n is None:
                raise AssertionError(f"locks: {node} is locked but no longer in the tree")
            count[n] = count.get(n, 0) + 1
            n = n.parent
    return count

"""The radix prefix cache with a host tier under it (after SGLang's HiCache).

Device memory is small and recomputing a long prefix is slow; a copy is cheap. So a node evicted from the
device keeps its KV in a larger host pool (write-back: copied on eviction; write-through: copied when the
node is cached), and a later match that reaches it gets the KV copied back to fresh device slots instead
of recomputed. The tree only does the accounting: the copies it decides are queued as slot lists
(`take_copies`) that the worker runs before the step that could reuse the slots. On CPU the host pool is
just a second pool; the mechanism is the same.

Host slots are handed out in pages by a `KVAllocator` over the host pool. Host eviction is LRU over
unlocked nodes that have a host copy: a node also on the device just drops the copy; a host-only node must
be a leaf and leaves the tree.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from protocol.messages import KVCopies
from scheduler.kv_allocator import KVAllocator
from scheduler.prefix_cache import MatchResult
from scheduler.radix_cache import RadixCache, TreeNode, _check


class HostRadixCache(RadixCache):
    def __init__(
        self,
        free_slots: Callable[[list[int]], None],
        host: KVAllocator,
        page_size: int = 1,
        write_through: bool = False,
    ) -> None:
        if host.page_size != page_size:
            raise ValueError(f"host pool pages of {host.page_size} slots, device pages of {page_size}")
        super().__init__(free_slots, page_size)
        self.host = host
        self.write_through = write_through
        self._copies = KVCopies()

    # ---- copies ---------------------------------------------------------------------------------
    def take_copies(self) -> KVCopies | None:
        c = self._copies
        if not c.to_host_src and not c.to_device_src:
            return None
        self._copies = KVCopies()
        # A slot written twice (a host copy evicted and its slots reused before the worker saw either):
        # only the last write counts, and a batched scatter must not see duplicates.
        c.to_host_src, c.to_host_dst = _last_writes(c.to_host_src, c.to_host_dst)
        c.to_device_src, c.to_device_dst = _last_writes(c.to_device_src, c.to_device_dst)
        return c

    def _backup(self, node: TreeNode) -> bool:
        """Give a device node a host copy (queued device -> host); False if the host pool can't fit it."""
        assert node.value is not None and node.host_value is None
        n = len(node.value)
        short = n - self.host.num_free
        if short > 0:
            self._evict_host(short)
        slots = self.host.alloc(n)
        if slots is None:
            return False
        slots.sort()  # consecutive host slots: the worker copies a run at once (one DMA on CUDA)
        node.host_value = slots
        self._copies.to_host_src += node.value
        self._copies.to_host_dst += slots
        return True

    def _on_new_leaf(self, node: TreeNode) -> None:
        if self.write_through:
            self._backup(node)  # a full host pool only means this node is not backed up yet

    # ---- load back --------------------------------------------------------------------------------
    def load_back(self, match: MatchResult, slots: list[int]) -> list[int]:
        """Put the host-only part of a match (locked by the caller) on the device slots given."""
        if len(slots) != match.host_hit_length:
            raise ValueError(f"load_back: {match.host_hit_length} host tokens but {len(slots)} device slots")
        path: list[TreeNode] = []
        node = match.last_host_node
        while node is not match.last_node:
            path.append(node)
            node = node.parent
        pos = 0
        for node in reversed(path):
            if node.lock_ref == 0 or node.value is not None or node.host_value is None:
                raise ValueError(f"load_back: {node} is not a locked host-only node")
            n = len(node.key)
            node.value = slots[pos : pos + n]
            self._copies.to_device_src += node.host_value
            self._copies.to_device_dst += node.value
            self._protected += n
            pos += n
        return match.indices + slots

    # ---- eviction ---------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free device slots LRU, leaf of the device part first; each node keeps its KV in the host tier
        (copied there now unless it has a copy already), or leaves the tree if the host tier is full."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            value = node.value
            assert value is not None and node.parent is not None
            parent = node.parent
            if node.host_value is None and not self._backup(node):
                self._drop_subtree(node)
            node.value = None
            self._evictable -= len(value)
            freed += len(value)
            self.free_slots(value)
            if self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def _device_leaf(self, node: TreeNode) -> bool:
        return (
            node is not self.root and node.value is not None and node.lock_ref == 0
            and all(c.value is None for c in node.children.values())
        )

    def _drop_subtree(self, node: TreeNode) -> None:
        """Take an unlocked node out of the tree; its host-only descendants go with it."""
        self._detach(node)
        stack = list(node.children.values())
        while stack:
            d = stack.pop()
            assert d.value is None and d.host_value is not None and d.lock_ref == 0
            self.host.free(d.host_value)
            d.host_value, d.parent = None, None
            stack.extend(d.children.values())
        node.children = {}

    def _host_evictable(self, node: TreeNode) -> bool:
        return (
            node is not self.root and node.host_value is not None and node.lock_ref == 0
            and (node.value is not None or not node.children)
        )

    def _evict_host(self, num_tokens: int) -> int:
        heap = [(n.last_access, n.id, n) for n in self._nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            hv = node.host_value
            assert hv is not None and node.parent is not None
            node.host_value = None
            self.host.free(hv)
            freed += len(hv)
            if node.value is None:  # host-only leaf: nothing of it is left
                parent = node.parent
                self._detach(node)
                if self._host_evictable(parent) and parent.value is None:
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # ---- sizes and invariants -------------------------------------------------------------------
    @property
    def host_size(self) -> int:
        return self.host.size

    @property
    def host_used(self) -> int:
        return self.host.size - self.host.num_free

    def check_integrity(self) -> None:
        super().check_integrity()
        self.host.check_integrity()
        p = self.page_size
        tree_pages = set(s // p for s in self.all_host_slots())
        free_pages = set(self.host.free_page_set())
        _check(not tree_pages & free_pages, f"host pages both free and in the tree: {sorted(tree_pages & free_pages)[:8]}")
        _check(len(tree_pages) + len(free_pages) == self.host.num_pages,
               f"host pages leaked: {len(tree_pages)} in the tree + {len(free_pages)} free "
               f"of {self.host.num_pages}")

    def reset(self) -> None:
        host = self.all_host_slots()
        super().reset()
        if host:
            self.host.free(host)
        self._copies = KVCopies()


def _last_writes(src: list[int], dst: list[int]) -> tuple[list[int], list[int]]:
    last = dict(zip(dst, src))  # later pairs overwrite earlier ones
    if len(last) == len(dst):
        return src, dst
    return list(last.values()), list(last)

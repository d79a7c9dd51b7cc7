"""The host tier under the radix tree: where a node's KV goes when it leaves the device (after SGLang's
HiCache), as a policy the tree calls (scheduler/radix_cache.py).

Device memory is small and recomputing a long prefix is slow; a copy is cheap. So a node evicted from the
device can keep its KV in a larger host pool, and a later match that reaches it gets the KV copied back
instead of recomputed. On CPU the host pool is just a second pool; the mechanism is the same.

Three policies: `NoHostTier` (evicted KV is dropped), `WriteBack` (copied to the host when the node leaves
the device) and `WriteThrough` (copied as soon as the node is cached, so eviction copies nothing). The
copies are queued on the tree (`tree.copies`). Host slots are handed out in pages by a `KVAllocator` over
the host pool. Host eviction is LRU over unlocked nodes that have a host copy: a node also on the device
just drops the copy; a host-only node must be a leaf and leaves the tree.
"""
from __future__ import annotations

import heapq
import typing
from typing import TYPE_CHECKING

from tandem.protocol.choices import HostKVPolicy
from tandem.scheduler.kv_allocator import KVAllocator
from tandem.scheduler.tree_node import TreeNode

if TYPE_CHECKING:
    from tandem.scheduler.radix_cache import RadixCache


class NoHostTier:
    """Device memory only: an evicted node's KV is dropped, and no node ever holds host slots.

    The calls every policy answers: bind (once, by the tree it serves), on_insert (a node just took device
    slots from insert), on_evict (a node leaves the device: True if its KV stays in the host tier, the
    node host-only), back_up (give a device node a host copy now: False if it cannot), free (host slots of
    nodes that left the tree), size and used (host slots), and check_integrity (given every host slot the
    tree's nodes hold)."""

    size = used = 0

    def bind(self, tree: RadixCache) -> None:
        return None  # no pool to match the tree's pages against

    def on_insert(self, node: TreeNode) -> None:
        return None

    def on_evict(self, node: TreeNode) -> bool:
        return False

    def back_up(self, node: TreeNode) -> bool:
        return False  # nowhere to copy to

    def free(self, slots: list[int]) -> None:
        self.check_integrity(slots)

    def check_integrity(self, tree_slots: list[int]) -> None:
        if tree_slots:
            raise AssertionError(f"radix cache: {len(tree_slots)} host slots without a host tier")


class WriteBack:
    """An evicted node's KV is copied to the host pool unless it has a copy there already; a full host pool
    first evicts its own LRU copies, and the node is dropped if even that makes no room."""

    tree: RadixCache  # the tree it serves, from bind()

    def __init__(self, pool: KVAllocator) -> None:
        self.pool = pool

    def bind(self, tree: RadixCache) -> None:
        if self.pool.page_size != tree.page_size:
            raise ValueError(
                f"host pool pages of {self.pool.page_size} slots, device pages of {tree.page_size}"
            )
        self.tree = tree

    def on_insert(self, node: TreeNode) -> None:
        return None  # write-back: nothing is copied until the node leaves the device

    def on_evict(self, node: TreeNode) -> bool:
        return node.host_value is not None or self.back_up(node)

    def back_up(self, node: TreeNode) -> bool:
        """Give a device node a host copy (queued device -> host); False if the host pool can't fit it."""
        assert node.value is not None and node.host_value is None
        n = len(node.value)
        short = n - self.pool.num_free
        if short > 0:
            self._evict_host(short)
        slots = self.pool.alloc(n)
        if slots is None:
            return False
        slots.sort()  # consecutive host slots: the worker copies a run at once (one DMA on CUDA)
        node.host_value = slots
        self.tree.copies.to_host_src += node.value
        self.tree.copies.to_host_dst += slots
        return True

    def free(self, slots: list[int]) -> None:
        self.pool.free(slots)

    def _host_evictable(self, node: TreeNode) -> bool:
        return (
            node is not self.tree.root
            and node.host_value is not None
            and node.lock_ref == node.host_lock_ref == 0
            and (node.value is not None or not node.children)
        )

    def _evict_host(self, num_tokens: int) -> int:
        heap = [(n.last_access, n.id, n) for n in self.tree.nodes() if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            hv = node.host_value
            assert hv is not None and node.parent is not None
            node.host_value = None
            self.pool.free(hv)
            freed += len(hv)
            if node.value is None:  # host-only leaf: nothing of it is left
                parent = node.parent
                self.tree.detach(node)
                if self._host_evictable(parent) and parent.value is None:
                    heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    @property
    def size(self) -> int:
        return self.pool.size

    @property
    def used(self) -> int:
        return self.pool.size - self.pool.num_free

    def check_integrity(self, tree_slots: list[int]) -> None:
        self.pool.check_integrity()
        p = self.pool.page_size
        tree_pages = set(s // p for s in tree_slots)
        free_pages = set(self.pool.free_page_set())
        if tree_pages & free_pages:
            raise AssertionError(f"radix cache: host pages both free and in the tree: "
                                 f"{sorted(tree_pages & free_pages)[:8]}")
        if len(tree_pages) + len(free_pages) != self.pool.num_pages:
            raise AssertionError(f"radix cache: host pages leaked: {len(tree_pages)} in the tree + "
                                 f"{len(free_pages)} free of {self.pool.num_pages}")


class WriteThrough(WriteBack):
    """A node's KV is copied to the host pool as soon as it is cached, so its eviction copies nothing."""

    def on_insert(self, node: TreeNode) -> None:
        self.back_up(node)  # a full host pool only means this node is not backed up yet (write-back later)


HostTier = NoHostTier | WriteBack  # WriteThrough is a WriteBack
POLICIES: dict[str, type[WriteBack]] = {"write_back": WriteBack, "write_through": WriteThrough}
assert tuple(POLICIES) == typing.get_args(HostKVPolicy)  # --host-kv-policy's values, one each

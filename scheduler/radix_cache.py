"""Radix prefix cache: a radix tree over token ids whose nodes own KV slots (after SGLang's RadixCache and
HiCache), on the device and, with a host tier, in a larger host pool.

Ownership: every device slot in a node belongs to the tree until `evict` (or `reset`) hands it back through
`free_slots`. Keys are page-aligned: every edge's key is a multiple of page_size long and children are keyed
by the first page of their edge, so siblings never share a first page and a split always lands on a page
boundary. Access times come from a counter ticked once per match/insert, so tests are deterministic.

A node's KV lives on the device (`value`), in the host tier (`host_value`), or both. The host tier is a
policy (scheduler/host_tier.py) the tree calls where a tier changes what happens: when a node is cached
(write-through copies it to the host at once) and when a node leaves the device (it stays in the tree,
host-only, or leaves it; with `NoHostTier` it always leaves, so every node is on the device). The device
part is prefix-closed: a node on the device has its parent on the device, so a match is a device run
followed by a host-only run, which `load_back` copies back to fresh device slots instead of recomputing.
The tree only does the accounting: the copies it decides are queued as slot lists (`take_copies`) that
the worker runs before the step that could reuse the slots.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence

from tandem.protocol.messages import KVCopies
from tandem.scheduler.host_tier import HostTier, NoHostTier
from tandem.scheduler.prefix_cache import PrefixHandle
from tandem.scheduler.radix_integrity import check_tree
from tandem.scheduler.tree_node import ChildKey, TreeNode


class RadixCache:
    def __init__(
        self, free_slots: Callable[[list[int]], None], page_size: int = 1, host: HostTier | None = None
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.free_slots = free_slots
        self.page_size = page_size
        self.host: HostTier = NoHostTier() if host is None else host
        self.host.bind(self)
        self.copies = KVCopies()  # device <-> host copies queued since the last take_copies()
        self._clock = 0
        self._new_root()

    def _new_root(self) -> None:
        self.root = TreeNode(None, [], [], 0)
        self._evictable = 0  # device slots in nodes with lock_ref == 0
        self._protected = 0  # device slots in locked nodes

    # ---- helpers -------------------------------------------------------------------------------
    def _aligned(self, key: Sequence[int]) -> list[int]:
        # Always a list: list slices never compare equal to tuple slices.
        return list(key[: len(key) // self.page_size * self.page_size])

    def _child_key(self, key: list[int], pos: int) -> ChildKey:
        return key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _match_len(self, edge: list[int], key: list[int], pos: int) -> int:
        """Page-aligned common prefix length of edge and key[pos:]; the first page is known to match."""
        n = min(len(edge), len(key) - pos)  # page-aligned: both lengths and pos are
        if edge[:n] == key[pos : pos + n]:  # the common case, compared in C
            return n
        ps, i = self.page_size, self.page_size
        if ps == 1:
            while edge[i] == key[pos + i]:
                i += 1
        else:
            while edge[i : i + ps] == key[pos + i : pos + i + ps]:
                i += ps
        return i  # a mismatch exists below n, so the loops stop in range

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut child's edge after m tokens; returns the new upper node. It inherits child's lock_ref (it is
        an ancestor of everything child's lockers locked) and last_access, so the size counters and the
        lock invariant hold without adjustment."""
        parent = child.parent
        assert parent is not None
        v, hv = child.value, child.host_value
        front = TreeNode(
            parent,
            child.key[:m],
            None if v is None else v[:m],
            child.last_access,
            None if hv is None else hv[:m],
        )
        front.lock_ref, front.host_lock_ref = child.lock_ref, child.host_lock_ref
        parent.children[self._child_key(front.key, 0)] = front  # same first page: replaces child
        child.key, child.parent = child.key[m:], front
        child.value, child.host_value = None if v is None else v[m:], None if hv is None else hv[m:]
        front.children[self._child_key(child.key, 0)] = child
        return front

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- API -----------------------------------------------------------------------------------
    def _walk(self, key: list[int]) -> Iterator[TreeNode]:
        """The nodes along key's longest cached page-aligned prefix, splitting the last one where the match
        ends inside its edge; each is marked accessed."""
        tick = self._tick()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                return
            m = self._match_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)  # only the matched part counts as accessed
            child.last_access = tick
            yield child
            node, pos = child, pos + m  # after a split, the next lookup misses and ends the walk

    def match_prefix(self, key: Sequence[int]) -> PrefixHandle:
        indices: list[int] = []
        last = host_last = self.root
        host_len = 0
        for node in self._walk(self._aligned(key)):
            if node.value is not None:  # prefix-closed: every device node comes before any host-only one
                indices += node.value
                last = node
            else:
                host_len += len(node.key)
            host_last = node
        return PrefixHandle(indices, last, host_last, host_len)

    def prefix_at(self, node: TreeNode) -> PrefixHandle:
        """The cached prefix that ends at node, found by walking up from it rather than by matching its
        tokens (node is one a holder keeps locked, so it is still in the tree); marked accessed."""
        tick = self._tick()
        indices: list[int] = []
        last = self.root
        host_len = 0
        for n in self._path(node):
            n.last_access = tick
            if n.value is not None:
                indices += n.value
                last = n
            else:
                host_len += len(n.key)
        return PrefixHandle(indices, last, node, host_len)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """node's ancestors (the root aside) and node, top down; node must be in the tree."""
        path: list[TreeNode] = []
        while node is not self.root:
            if node.parent is None:
                raise ValueError(f"{node} is not in the tree (evicted or reset)")
            path.append(node)
            node = node.parent
        return path[::-1]

    def load_back(self, match: PrefixHandle, slots: list[int]) -> list[int]:
        """Put the host-only part of a match (locked by the caller) on the device slots given."""
        if len(slots) != match.host_hit_length:
            raise ValueError(f"load_back: {match.host_hit_length} host tokens but {len(slots)} device slots")
        path: list[TreeNode] = []
        node: TreeNode | None = match.last_host_node
        while node is not match.last_node and node is not None:
            path.append(node)
            node = node.parent
        pos = 0
        for node in reversed(path):
            if node.lock_ref == 0 or node.value is not None or node.host_value is None:
                raise ValueError(f"load_back: {node} is not a locked host-only node")
            n = len(node.key)
            node.value = slots[pos : pos + n]
            self.copies.to_device_src += node.host_value
            self.copies.to_device_dst += node.value
            self._protected += n
            pos += n
        return match.indices + slots

    def take_copies(self) -> KVCopies | None:
        c = self.copies
        if not c.to_host_src and not c.to_device_src:
            return None
        self.copies = KVCopies()
        # A slot written twice (a host copy evicted and its slots reused before the worker saw either):
        # only the last write counts, and a batched scatter must not see duplicates.
        c.to_host_src, c.to_host_dst = _last_writes(c.to_host_src, c.to_host_dst)
        c.to_device_src, c.to_device_dst = _last_writes(c.to_device_src, c.to_device_dst)
        return c

    def insert(self, key: Sequence[int], indices: Sequence[int]) -> int:
        """Cache key -> indices (both cut down to whole pages). Returns how many leading tokens were
        already cached on the device: the caller still owns indices[:that] (and the unaligned tail); the
        tree takes the slots in between, including those of host-only nodes on the path, which they bring
        back to the device."""
        if len(key) != len(indices):
            raise ValueError(f"insert: {len(key)} tokens but {len(indices)} slots")
        key = self._aligned(key)
        n, tick = len(key), self._tick()
        node, pos = self.root, 0
        held: int | None = None  # where the tree's device part of the path ends
        while pos < n:
            ck = self._child_key(key, pos)
            child = node.children.get(ck)
            if child is None:
                leaf = node.children[ck] = TreeNode(node, key[pos:], list(indices[pos:n]), tick)
                self._evictable += n - pos
                self.host.on_insert(leaf)
                return pos if held is None else held
            m = self._match_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = tick
            if child.value is None:  # host-only: the caller's freshly computed KV puts it back on the device
                held = pos if held is None else held
                child.value = list(indices[pos : pos + m])
                if child.lock_ref:
                    self._protected += m
                else:
                    self._evictable += m
            node, pos = child, pos + m
        return n if held is None else held

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock node and its ancestors (the root is never locked: it holds nothing)."""
        while node is not self.root:
            if node.parent is None:
                raise ValueError(f"{node} is not in the tree (evicted or reset)")
            if node.lock_ref == 0:
                self._evictable -= node.device_len
                self._protected += node.device_len
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.parent is None:
                raise ValueError(f"{node} is not in the tree (evicted or reset)")
            if node.lock_ref <= 0:
                raise AssertionError(f"radix cache: unbalanced dec_lock_ref on {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += node.device_len
                self._protected -= node.device_len
            node = node.parent

    def back_up(self, node: TreeNode) -> bool:
        """Give node and its ancestors (all on the device) a host copy, queued device -> host; False when the
        host tier cannot (there is none, or it is full of what it must keep)."""
        return all(n.host_value is not None or self.host.back_up(n) for n in self._path(node))

    def inc_host_lock(self, node: TreeNode) -> None:
        """Keep node's and its ancestors' host copies (`back_up` made them); the device copies may go."""
        while node is not self.root:
            if node.parent is None or node.host_value is None:
                raise ValueError(f"{node} is not in the tree or has no host copy")
            node.host_lock_ref += 1
            node = node.parent

    def dec_host_lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.parent is None or node.host_lock_ref <= 0:
                raise AssertionError(f"radix cache: unbalanced dec_host_lock on {node}")
            node.host_lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens device slots if the unlocked part of the tree holds that many, LRU, leaf
        of the device part first. Returns the number freed. The host tier keeps each node's KV (the node
        stays, host-only) or lets it go: then it leaves the tree with its host-only subtree."""
        if num_tokens <= 0:
            return 0
        # A child's lock_ref <= its parent's, so an unlocked node's subtree is unlocked.
        heap = [(n.last_access, n.id, n) for n in self.nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            value, parent = node.value, node.parent
            assert value is not None and parent is not None
            if not self.host.on_evict(node):
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
        self.detach(node)
        stack = list(node.children.values())
        while stack:
            d = stack.pop()
            assert d.value is None and d.host_value is not None and d.lock_ref == d.host_lock_ref == 0
            self.host.free(d.host_value)
            d.host_value, d.parent = None, None
            stack.extend(d.children.values())
        node.children = {}

    def detach(self, node: TreeNode) -> None:
        assert node.parent is not None
        del node.parent.children[self._child_key(node.key, 0)]
        node.parent = None

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    @property
    def host_size(self) -> int:
        return self.host.size

    @property
    def host_used(self) -> int:
        return self.host.used

    def all_slots(self) -> list[int]:
        return [slot for node in self.nodes() if node.value is not None for slot in node.value]

    def all_host_slots(self) -> list[int]:
        return [slot for node in self.nodes() if node.host_value is not None for slot in node.host_value]

    def check_integrity(self) -> None:
        """Every invariant of the tree and its tiers (scheduler/radix_integrity.py); raises on the first
        broken."""
        check_tree(self)

    def reset(self) -> None:
        """Drop the whole tree, handing every slot back (device ones through free_slots, host ones to the
        host tier). Nothing may be locked."""
        if self._protected:
            raise RuntimeError(f"radix cache: reset with {self._protected} locked slots")
        slots, host = self.all_slots(), self.all_host_slots()
        self._new_root()
        self.copies = KVCopies()
        if slots:
            self.free_slots(slots)
        if host:
            self.host.free(host)


def _last_writes(src: list[int], dst: list[int]) -> tuple[list[int], list[int]]:
    last = dict(zip(dst, src))  # later pairs overwrite earlier ones
    if len(last) == len(dst):
        return src, dst
    return list(last.values()), list(last)

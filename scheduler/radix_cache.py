"""Radix prefix cache: a radix tree over token ids whose nodes own KV slots (after SGLang's RadixCache).

Ownership: every slot in a node belongs to the tree until `evict` (or `reset`) hands it back through
`free_slots`. Keys are page-aligned: every edge's key is a multiple of page_size long and children are keyed
by the first page of their edge, so siblings never share a first page and a split always lands on a page
boundary. Access times come from a counter ticked once per match/insert, so tests are deterministic.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

ChildKey = int | tuple[int, ...]


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")
    _ids = itertools.count()  # heap tie-break, so eviction order never compares nodes

    def __init__(self, parent: TreeNode | None, key: list[int], value: list[int], last_access: int) -> None:
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.key = key
        self.value = value  # KV slots, one per token of key
        self.lock_ref = 0
        self.last_access = last_access
        self.id = next(TreeNode._ids)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access})"


@dataclass
class MatchResult:
    indices: list[int]  # KV slots of the matched prefix (length is a multiple of page_size)
    last_node: TreeNode  # deepest matched node (the root when nothing matched)


def _check(cond: bool, msg: str) -> None:
    # Not `assert`: integrity checks must survive `python -O`.
    if not cond:
        raise AssertionError(f"radix cache: {msg}")


class RadixCache:
    def __init__(self, free_slots: Callable[[list[int]], None], page_size: int = 1, disabled: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.free_slots = free_slots
        self.page_size = page_size
        self.disabled = disabled
        self._clock = 0
        self._new_root()

    def _new_root(self) -> None:
        self.root = TreeNode(None, [], [], 0)
        self._evictable = 0  # slots in nodes with lock_ref == 0
        self._protected = 0  # slots in locked nodes

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
        front = TreeNode(parent, child.key[:m], child.value[:m], child.last_access)
        front.lock_ref = child.lock_ref
        parent.children[self._child_key(front.key, 0)] = front  # same first page: replaces child
        child.key, child.value, child.parent = child.key[m:], child.value[m:], front
        front.children[self._child_key(child.key, 0)] = child
        return front

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- API -----------------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        if self.disabled:
            return MatchResult([], self.root)
        key = self._aligned(key)
        tick = self._tick()
        node, pos, indices = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._match_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)  # only the matched part counts as accessed
            child.last_access = tick
            indices += child.value
            node, pos = child, pos + m  # after a split, the next lookup misses and ends the loop
        return MatchResult(indices, node)

    def insert(self, key: Sequence[int], indices: Sequence[int]) -> int:
        """Cache key -> indices (both cut down to whole pages). Returns how many leading tokens were
        already cached: the caller still owns indices[:that] (and the unaligned tail); the tree takes the
        slots in between."""
        if len(key) != len(indices):
            raise ValueError(f"insert: {len(key)} tokens but {len(indices)} slots")
        if self.disabled:
            return 0
        key = self._aligned(key)
        n, tick = len(key), self._tick()
        node, pos = self.root, 0
        while pos < n:
            ck = self._child_key(key, pos)
            child = node.children.get(ck)
            if child is None:
                node.children[ck] = TreeNode(node, key[pos:], list(indices[pos:n]), tick)
                self._evictable += n - pos
                return pos
            m = self._match_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = tick
            node, pos = child, pos + m
        return n

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock node and its ancestors (the root is never locked: it holds nothing)."""
        while node is not self.root:
            if node.parent is None:
                raise ValueError(f"{node} is not in the tree (evicted or reset)")
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
                self._protected += len(node.value)
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
                self._evictable += len(node.value)
                self._protected -= len(node.value)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots if the unlocked part of the tree holds that many, leaf by leaf,
        least recently used first. Returns the number freed."""
        if num_tokens <= 0:
            return 0
        # Unlocked leaves only; a child's lock_ref <= its parent's, so an unlocked node's subtree is unlocked.
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            self._evictable -= len(node.value)
            freed += len(node.value)
            self.free_slots(node.value)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def all_slots(self) -> list[int]:
        return [slot for node in self._nodes() for slot in node.value]

    def check_integrity(self) -> None:
        root, ps = self.root, self.page_size
        _check(root.parent is None and not root.key and not root.value and root.lock_ref == 0, "bad root")
        evictable = protected = count = 0
        seen: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                _check(child.parent is node, f"{child}: wrong parent pointer")
                _check(len(child.key) > 0, f"{child}: empty key")
                _check(len(child.key) % ps == 0, f"{child}: key length {len(child.key)} not page-aligned")
                _check(len(child.key) == len(child.value), f"{child}: {len(child.key)} tokens, "
                       f"{len(child.value)} slots")
                _check(self._child_key(child.key, 0) == ck, f"{child}: key doesn't start with its edge's page")
                _check(child.lock_ref >= 0, f"{child}: negative lock_ref")
                _check(node is root or child.lock_ref <= node.lock_ref, f"{child}: locked more than its parent")
                _check(node is root or child.last_access <= node.last_access, f"{child}: newer than its parent")
                if child.lock_ref:
                    protected += len(child.value)
                else:
                    evictable += len(child.value)
                count += len(child.value)
                seen.update(child.value)
                stack.append(child)
        _check(len(seen) == count, "a slot is in two places")
        _check(evictable == self._evictable, f"evictable_size {self._evictable} != recomputed {evictable}")
        _check(protected == self._protected, f"protected_size {self._protected} != recomputed {protected}")

    def reset(self) -> None:
        """Drop the whole tree, handing every slot back through free_slots. Nothing may be locked."""
        if self._protected:
            raise RuntimeError(f"radix cache: reset with {self._protected} locked slots")
        slots = self.all_slots()
        self._new_root()
        if slots:
            self.free_slots(slots)

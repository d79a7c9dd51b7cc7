"""The prefix cache that caches nothing (`--no-prefix-cache`): every match is empty and every insert is
handed back, so every request computes its whole prompt and frees all of its KV."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from tandem.protocol.messages import KVCopies
from tandem.scheduler.prefix_cache import PrefixHandle
from tandem.scheduler.tree_node import TreeNode


class NoPrefixCache:
    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.root = TreeNode(None, [], [], 0)  # what an empty match points at; locking it is a no-op

    def match_prefix(self, key: Sequence[int]) -> PrefixHandle:
        return PrefixHandle([], self.root, self.root, 0)

    def prefix_at(self, node: TreeNode) -> PrefixHandle:
        return self.match_prefix([])

    def nodes(self) -> Iterator[TreeNode]:
        return iter(())

    def load_back(self, match: PrefixHandle, slots: list[int]) -> list[int]:
        if match.host_hit_length or slots:
            raise ValueError("load_back: this cache has no host tier")
        return []

    def insert(self, key: Sequence[int], indices: Sequence[int]) -> int:
        if len(key) != len(indices):
            raise ValueError(f"insert: {len(key)} tokens but {len(indices)} slots")
        return len(key)  # "all of it was cached already": the caller keeps every slot

    def inc_lock_ref(self, node: TreeNode) -> None:
        if node is not self.root:
            raise ValueError(f"{node} is not this cache's node")

    dec_lock_ref = inc_lock_ref

    def evict(self, num_tokens: int) -> int:
        return 0

    def take_copies(self) -> KVCopies | None:
        return None

    evictable_size = protected_size = host_size = host_used = 0

    def all_slots(self) -> list[int]:
        return []

    def check_integrity(self) -> None:
        return None

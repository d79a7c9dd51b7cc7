"""A node of the radix prefix cache: an edge of token ids and the KV slots that hold them, on the device,
in the host tier, or both (at least one)."""
from __future__ import annotations

import itertools

ChildKey = int | tuple[int, ...]  # a child's first token (page_size 1) or first page


class TreeNode:
    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "host_value",
        "lock_ref",
        "host_lock_ref",
        "last_access",
        "id",
    )
    _ids = itertools.count()  # heap tie-break, so eviction order never compares nodes

    def __init__(
        self, parent: TreeNode | None, key: list[int], value: list[int] | None, last_access: int,
        host_value: list[int] | None = None,
    ) -> None:
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent  # None for the root and for evicted (detached) nodes
        self.key = key
        self.value = value  # device KV slots, one per token of key; None: not on the device
        self.host_value = host_value  # host-tier slots, one per token of key; None: not in the host tier
        self.lock_ref = 0  # pinned where it is, device and host tier (a running request's prefix)
        # its host copy must stay, the device one may go (a session's, on the host tier)
        self.host_lock_ref = 0
        self.last_access = last_access
        self.id = next(TreeNode._ids)

    @property
    def device_len(self) -> int:
        return len(self.value) if self.value is not None else 0

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref}, "
            f"host_lock={self.host_lock_ref}, t={self.last_access})"
        )

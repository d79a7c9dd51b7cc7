"""The prefix-cache interface the KV manager talks to, and the handle on a cached prefix: what a match
returns and what a request holds while it runs (`Req.prefix`).

Two implementations, which the KV manager takes either of: `RadixCache` (a radix tree whose nodes keep
their KV on the device and, with a host tier policy from scheduler/host_tier.py, in a larger host pool)
and `NoPrefixCache` (caches nothing). Besides the calls below both report `evictable_size`,
`protected_size`, `host_size` and `host_used` (0 without a host tier) and list `all_slots()`.

Contract, in the terms of the request's row (slots of token positions 0..n):
- `match_prefix(key)` finds the longest cached, page-aligned prefix of key. `indices` are the device slots
  of its leading part that is on the device, ending at `last_node`; `host_hit_length` more tokens, ending
  at `last_host_node`, are only in the host tier (0 without one). It has no effect on ownership.
- `inc_lock_ref(node)` / `dec_lock_ref(node)` pin node and its ancestors (both tiers) against eviction;
  a request locks the deepest node it uses for as long as it runs.
- `load_back(match, slots)` gives the (locked) host part of a match the device slots `slots`, which the
  tree owns from then on, and queues the host -> device copies; it returns the device slots of the whole
  match. The caller allocated the slots.
- `insert(key, indices)` caches key -> device slots. It returns how many leading tokens the tree already
  held on the device: the caller keeps owning indices[:that] (and the tail past the last whole page);
  the tree takes the slots in between. `NoPrefixCache` returns len(key): it takes nothing.
- `evict(n)` frees at least n device slots from unlocked nodes if it can (LRU), returning the number;
  with a host tier, their KV stays in the host pool (copied there now, or at insert with write-through).
- `take_copies()` hands over the device <-> host copies queued since the last call (None when there are
  none); they must reach the worker before any step that reuses the evicted device slots.
- `check_integrity()` raises AssertionError on a broken invariant, in either tier.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.scheduler.tree_node import TreeNode


@dataclass
class PrefixHandle:
    """A cached prefix: what a match found, and what a request holds (locked) while it has a row. The
    scheduler reads the slots and lengths; the nodes are for the cache's own calls."""

    indices: list[int]  # device KV slots of the prefix's on-device part (whole pages)
    last_node: TreeNode  # deepest node of it on the device (the root when none)
    last_host_node: TreeNode  # deepest node of it overall; its part past last_node is host-only
    host_hit_length: int  # tokens of it in the host tier only, after `indices`

    @property
    def length(self) -> int:
        """Tokens of the prefix, both tiers."""
        return len(self.indices) + self.host_hit_length


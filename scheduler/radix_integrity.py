"""The radix prefix cache's invariants (scheduler/radix_cache.py's `check_integrity`): what every node holds,
its locks against its parent's, each slot in one place, and the sizes the tree keeps against a recount."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.scheduler.radix_cache import RadixCache


def check(cond: bool, msg: str) -> None:
    # Not `assert`: integrity checks must survive `python -O`.
    if not cond:
        raise AssertionError(f"radix cache: {msg}")


def check_tree(cache: RadixCache) -> None:
    root, ps = cache.root, cache.page_size
    check(root.parent is None and not root.key and not root.value and root.lock_ref == 0, "bad root")
    evictable = protected = count = host_count = 0
    seen: set[int] = set()
    host_seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        for ck, child in node.children.items():
            check(child.parent is node, f"{child}: wrong parent pointer")
            check(len(child.key) > 0, f"{child}: empty key")
            check(len(child.key) % ps == 0, f"{child}: key length {len(child.key)} not page-aligned")
            check(child.value is not None or child.host_value is not None, f"{child}: holds no KV")
            for v, tier in ((child.value, "device"), (child.host_value, "host")):
                check(v is None or len(v) == len(child.key), f"{child}: {len(child.key)} tokens, "
                       f"{len(v or [])} {tier} slots")
            check(child.value is None or node is root or node.value is not None,
                   f"{child}: on the device under a host-only parent")
            check(
                cache._child_key(child.key, 0) == ck, f"{child}: key doesn't start with its edge's page"
            )
            check(child.lock_ref >= 0, f"{child}: negative lock_ref")
            check(
                node is root or child.lock_ref <= node.lock_ref, f"{child}: locked more than its parent"
            )
            check(
                node is root or child.host_lock_ref <= node.host_lock_ref,
                f"{child}: host-locked more than its parent",
            )
            check(
                not child.host_lock_ref or child.host_value is not None,
                f"{child}: host-locked, no host copy",
            )
            check(
                node is root or child.last_access <= node.last_access, f"{child}: newer than its parent"
            )
            if child.lock_ref:
                protected += child.device_len
            else:
                evictable += child.device_len
            count += child.device_len
            seen.update(child.value or [])
            host_count += len(child.host_value or [])
            host_seen.update(child.host_value or [])
            stack.append(child)
    check(len(seen) == count, "a device slot is in two places")
    check(len(host_seen) == host_count, "a host slot is in two places")
    check(evictable == cache._evictable, f"evictable_size {cache._evictable} != recomputed {evictable}")
    check(protected == cache._protected, f"protected_size {cache._protected} != recomputed {protected}")
    cache.host.check_integrity(cache.all_host_slots())


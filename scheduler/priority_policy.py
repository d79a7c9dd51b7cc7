"""The order requests are served in (`--scheduling-policy`): which waiting request is admitted next, in
which order the running ones draw on the step's budget, and which one is retracted when the KV pool
runs short. Socket-free; the scheduler owns one and the tests drive it directly.

`fcfs`: arrival order; a retracted request goes back to the head of the queue, and the victim of a
retraction is the running request with the fewest outputs (the least work to redo). Priorities are
ignored. `priority` (vLLM's convention: a lower number is served first): admission and the running
order by (priority, arrival), so equal priorities are first come first served and none of them waits
forever behind a later one; the victim is the lowest priority (highest number), the latest arrival
among equals, and never one that comes before the request that needs the room.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from tandem.scheduler.req import Req

POLICIES = ("fcfs", "priority")


def _evictable(r: Req, exclude: Req) -> bool:
    # Only a request with nothing in flight: its KV is not being written by a step the worker runs.
    return r is not exclude and r.num_inflight_steps == 0 and r.req_pool_idx is not None


class FcfsPolicy:
    """First come, first served. The waiting queue is a deque: new requests at the tail, retracted
    ones back at the head (they were admitted before anything still waiting)."""

    name = "fcfs"

    def __init__(self) -> None:
        self._q: deque[Req] = deque()

    # ---- the waiting queue --------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self._q.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request waits again."""
        self._q.appendleft(req)

    def peek(self) -> Req | None:
        return self._q[0] if self._q else None

    def pop(self) -> Req:
        return self._q.popleft()

    def remove(self, req: Req) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._q)

    def __contains__(self, req: object) -> bool:
        return req in self._q

    # ---- running requests ---------------------------------------------------------------------
    def running_order(self, running: list[Req]) -> list[Req]:
        return list(running)

    def victim(self, running: list[Req], exclude: Req) -> Req | None:
        """Whom to retract so that `exclude` can grow; None: nobody may be."""
        candidates = [r for r in running if _evictable(r, exclude)]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (len(r.output_ids), -r.arrival))


def _key(r: Req) -> tuple[int, int]:
    return (r.priority, r.arrival)


class PriorityPolicy:
    """Lower priority number first, then arrival. The waiting queue is a list kept sorted by that key:
    a retracted request keeps its arrival, so it goes back ahead of every later one of its priority."""

    name = "priority"

    def __init__(self) -> None:
        self._l: list[Req] = []

    def add(self, req: Req) -> None:
        bisect.insort(self._l, req, key=_key)

    requeue = add

    def peek(self) -> Req | None:
        return self._l[0] if self._l else None

    def pop(self) -> Req:
        return self._l.pop(0)

    def remove(self, req: Req) -> None:
        self._l.remove(req)

    def __len__(self) -> int:
        return len(self._l)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._l)

    def __contains__(self, req: object) -> bool:
        return req in self._l

    def running_order(self, running: list[Req]) -> list[Req]:
        return sorted(running, key=_key)

    def victim(self, running: list[Req], exclude: Req) -> Req | None:
        """The lowest priority, latest arrival, of those after `exclude` in the serving order: a request
        never loses its KV to one that is served after it."""
        mine = _key(exclude)
        candidates = [r for r in running if _evictable(r, exclude) and _key(r) > mine]
        return max(candidates, key=_key, default=None)


SchedulingPolicy = FcfsPolicy | PriorityPolicy  # one interface: the waiting queue, running order, victims


def make_policy(name: str) -> SchedulingPolicy:
    if name == "priority":
        return PriorityPolicy()
    if name == "fcfs":
        return FcfsPolicy()
    raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(POLICIES)}")

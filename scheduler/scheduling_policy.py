"""The order requests are served in (`--scheduling-policy`): which waiting request is admitted next, in
which order the running ones draw on the step's budget, and which one is retracted when the KV pool runs
short. `SchedulingPolicy` is the interface the scheduler calls (vLLM's RequestQueue is the model); FCFS and
priority are its two implementations. Socket-free; the scheduler owns one and the tests drive it directly.

`fcfs`: arrival order; a retracted request goes back to the head of the queue, and the victim of a
retraction is the running request with the fewest outputs (the least work to redo). Priorities are ignored.
`priority` (vLLM's convention: a lower number is served first): admission and the running order by
(priority, arrival), so equal priorities are first come first served and none of them waits forever behind
a later one; the victim is the lowest priority (highest number), the latest arrival among equals, and never
one that comes before the request that needs the room.
"""

from __future__ import annotations

import abc
import bisect
import typing
from collections import deque
from collections.abc import Iterator

from tandem.protocol.choices import SchedulingPolicyName
from tandem.scheduler.req import Req


def _evictable(r: Req, exclude: Req) -> bool:
    # Only a request with nothing in flight: its KV is not being written by a step the worker runs.
    return r is not exclude and r.num_inflight_steps == 0 and r.req_pool_idx is not None


class SchedulingPolicy(abc.ABC):
    """The waiting queue in the policy's order, the running requests' order and the victim of a
    retraction."""

    name: SchedulingPolicyName

    @abc.abstractmethod
    def add(self, req: Req) -> None:
        """A new request waits."""

    @abc.abstractmethod
    def requeue(self, req: Req) -> None:
        """A retracted request waits again."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Req]:
        """The waiting requests, the next to admit first."""

    @abc.abstractmethod
    def pop(self) -> Req:
        """Takes the next request to admit."""

    @abc.abstractmethod
    def remove(self, req: Req) -> None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def running_order(self, running: list[Req]) -> list[Req]:
        """The order the running requests draw on a step's budget."""

    @abc.abstractmethod
    def victim(self, running: list[Req], exclude: Req) -> Req | None:
        """Whom to retract so that `exclude` can grow; None: nobody may be."""

    def peek(self) -> Req | None:
        return next(iter(self), None)

    def __contains__(self, req: object) -> bool:
        return any(r is req for r in self)


class FcfsPolicy(SchedulingPolicy):
    """First come, first served. The waiting queue is a deque: new requests at the tail, retracted ones back
    at the head (they were admitted before anything still waiting)."""

    name = "fcfs"

    def __init__(self) -> None:
        self._q: deque[Req] = deque()

    def add(self, req: Req) -> None:
        self._q.append(req)

    def requeue(self, req: Req) -> None:
        self._q.appendleft(req)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._q)

    def pop(self) -> Req:
        return self._q.popleft()

    def remove(self, req: Req) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def running_order(self, running: list[Req]) -> list[Req]:
        return list(running)

    def victim(self, running: list[Req], exclude: Req) -> Req | None:
        candidates = [r for r in running if _evictable(r, exclude)]
        return min(candidates, key=lambda r: (len(r.output_ids), -r.arrival), default=None)


def _key(r: Req) -> tuple[int, int]:
    return (r.priority, r.arrival)


class PriorityPolicy(SchedulingPolicy):
    """Lower priority number first, then arrival. The waiting queue is a list kept sorted by that key: a
    retracted request keeps its arrival, so it goes back ahead of every later one of its priority."""

    name = "priority"

    def __init__(self) -> None:
        self._l: list[Req] = []

    def add(self, req: Req) -> None:
        bisect.insort(self._l, req, key=_key)

    def requeue(self, req: Req) -> None:
        self.add(req)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._l)

    def pop(self) -> Req:
        return self._l.pop(0)

    def remove(self, req: Req) -> None:
        self._l.remove(req)

    def __len__(self) -> int:
        return len(self._l)

    def running_order(self, running: list[Req]) -> list[Req]:
        return sorted(running, key=_key)

    def victim(self, running: list[Req], exclude: Req) -> Req | None:
        """The lowest priority, latest arrival, of those after `exclude` in the serving order: a request
        never loses its KV to one that is served after it."""
        mine = _key(exclude)
        candidates = [r for r in running if _evictable(r, exclude) and _key(r) > mine]
        return max(candidates, key=_key, default=None)


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FcfsPolicy, "priority": PriorityPolicy}
assert tuple(POLICIES) == typing.get_args(SchedulingPolicyName)


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]()

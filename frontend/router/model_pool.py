"""Which models are loaded, socket-free: the policy of a many-model server, driven by its tests with fake
engines.

A model's engine starts on its first request (concurrent first requests start it once: they all await the
same load), stays while requests run, and unloads after its keep-alive once idle (0: at once, FOREVER:
never) or when another needs its place under `max_loaded` and the memory budget (least recently used
first; never one with
requests running, never a pinned one). A load that fails fails the requests waiting on it; the next request
tries again. An engine that died is forgotten and started again on the next request.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tandem.protocol.choices import ModelState
from tandem.protocol.model_spec import FOREVER, ModelSpec

ROOM_WAIT_S = 120.0  # a load waits this long for a loaded model to go idle before it is refused


class Engine(Protocol):
    url: str

    def alive(self) -> bool: ...

    async def stop(self) -> None: ...


class UnknownModel(LookupError):
    pass


class LoadFailed(RuntimeError):
    pass


class NoRoom(RuntimeError):
    pass


@dataclass
class ModelEntry:
    spec: ModelSpec
    keep_alive_s: float  # the last request's (ollama's rule), else the spec's, else the server's
    state: ModelState = "unloaded"
    engine: Engine | None = None
    running: int = 0  # requests holding a lease
    last_used: float = 0.0
    idle_since: float | None = None  # when running last fell to 0 (None: running, or never loaded)
    error: str | None = None  # the last load's failure
    loads: int = 0
    size: int = 0  # bytes it holds loaded (prepare's figure; 0 unknown)
    # Chosen to make room for another model's load: it takes no new requests (they wait to load it again
    # after), so its running ones end and the load behind it is not starved by a stream of new ones.
    draining: bool = False
    has_room: bool = False  # loading, past _make_room: counts against the limits while its engine starts
    load: asyncio.Future | None = field(default=None, repr=False)

    @property
    def expires_at(self) -> float | None:
        """Monotonic time the engine unloads if nothing comes (None: never, or busy)."""
        if self.spec.pinned or self.keep_alive_s == FOREVER or self.state != "loaded":
            return None
        since = self.idle_since if self.running == 0 and self.idle_since is not None else self.last_used
        return since + self.keep_alive_s


class ModelPool:
    def __init__(self, specs: list[ModelSpec], max_loaded: int, keep_alive_s: float,
                 starter: Callable[[ModelSpec], Awaitable[Engine]],
                 clock: Callable[[], float] = time.monotonic, room_wait_s: float = ROOM_WAIT_S,
                 prepare: Callable[[ModelSpec], Awaitable[int]] | None = None,
                 memory_budget: int | None = None) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded_models={max_loaded}: must be >= 1")
        pinned = sum(s.pinned for s in specs)
        if pinned > max_loaded:
            raise ValueError(f"{pinned} pinned models do not fit max_loaded_models={max_loaded}")
        self.entries = {s.name: ModelEntry(s, s.keep_alive_s if s.keep_alive_s is not None else keep_alive_s)
                        for s in specs}
        self.max_loaded, self._start, self._clock, self.room_wait_s = max_loaded, starter, clock, room_wait_s
        # What can fail before anything is unloaded for it (a missing file, a pull); it returns the bytes the
        # model will hold, which count against memory_budget.
        self._prepare, self.memory_budget = prepare, memory_budget
        self._changed = asyncio.Condition()  # a lease released or an engine stopped: room may be free
        self._stops: set[asyncio.Task] = set()

    # -- requests -------------------------------------------------------------------------------------------
    def entry(self, name: str) -> ModelEntry:
        e = self.entries.get(name)
        if e is None:
            raise UnknownModel(name)
        return e

    async def acquire(self, name: str, keep_alive_s: float | None = None) -> Engine:
        """A lease on NAME's engine (started when needed); release() it when the request ends."""
        e = self.entry(name)
        if keep_alive_s is not None:
            e.keep_alive_s = keep_alive_s
        while True:
            if e.state == "loaded" and e.draining:
                async with self._changed:
                    await self._changed.wait()
                continue
            if e.state == "loaded" and e.engine is not None:
                if e.engine.alive():
                    e.running += 1
                    e.last_used, e.idle_since = self._clock(), None
                    return e.engine
                self._forget(e)  # died: start it again below
            if e.load is None:
                e.load = asyncio.get_running_loop().create_future()
                e.load.add_done_callback(_consume)  # nobody may be waiting when it fails
                e.state, e.error = "loading", None
                asyncio.ensure_future(self._load(e))
            await asyncio.shield(e.load)  # a caller who leaves does not cancel the others' load

    def release(self, name: str) -> None:
        e = self.entry(name)
        assert e.running > 0, f"release of {name} without a lease"
        e.running -= 1
        e.last_used = self._clock()
        if e.running == 0:
            e.idle_since = e.last_used
            if (e.keep_alive_s == 0 or e.draining) and not e.spec.pinned:
                self._stop_later(e)
        self._notify()

    async def unload(self, name: str) -> bool:
        """Unload NAME now when it runs nothing and is not pinned (ollama's keep_alive 0 with no prompt);
        whether it is unloaded after."""
        e = self.entry(name)
        if e.state == "loaded" and e.running == 0 and not e.spec.pinned:
            await self._stop(e)
        return e.state != "loaded"

    # -- housekeeping ---------------------------------------------------------------------------------------
    async def reap(self) -> list[str]:
        """Stop idle engines past their keep-alive and forget dead ones; returns the names unloaded."""
        now, out = self._clock(), []
        for e in self.entries.values():
            if e.state == "loaded" and e.engine is not None and not e.engine.alive():
                self._forget(e)
                out.append(e.spec.name)
            elif e.running == 0 and (t := e.expires_at) is not None and t <= now:
                await self._stop(e)
                out.append(e.spec.name)
        return out

    async def load_pinned(self) -> None:
        for e in self.entries.values():
            if e.spec.pinned:
                try:
                    await self.acquire(e.spec.name)
                except LoadFailed:
                    continue  # its error shows in /v1/models; requests retry the load
                self.release(e.spec.name)

    async def close(self) -> None:
        for task in list(self._stops):
            await task
        for e in self.entries.values():
            if e.engine is not None:
                await self._stop(e)

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.state == "loaded"]

    def check_integrity(self) -> None:
        held = [e for e in self.entries.values() if self._holds(e)]
        assert len(held) <= self.max_loaded, f"{len(held)} models held, limit {self.max_loaded}"
        loaded = sum(e.size for e in held if e.state == "loaded")
        assert self.memory_budget is None or loaded <= self.memory_budget, f"{loaded} bytes loaded"
        for e in self.entries.values():
            assert e.running >= 0
            assert (e.engine is not None) == (e.state == "loaded"), e
            assert (e.load is not None) == (e.state == "loading"), e
            assert not e.draining or e.state == "loaded", e
            assert not e.has_room or e.state == "loading", e

    # -- internals ------------------------------------------------------------------------------------------
    async def _load(self, e: ModelEntry) -> None:
        fut = e.load
        assert fut is not None
        try:
            if self._prepare is not None:
                e.size = await self._prepare(e.spec)
            await self._make_room(e)
            engine = await self._start(e.spec)
        except BaseException as exc:
            e.state, e.load, e.error, e.has_room = "failed", None, _why(exc), False
            err = exc if isinstance(exc, (NoRoom, LoadFailed)) else LoadFailed(
                f"model {e.spec.name!r} failed to load: {e.error}")
            fut.set_exception(err)
            self._notify()
            return
        e.engine, e.state, e.load, e.loads, e.has_room = engine, "loaded", None, e.loads + 1, False
        e.last_used, e.idle_since = self._clock(), self._clock()
        fut.set_result(None)

    async def _make_room(self, e: ModelEntry) -> None:
        """Until this load fits under max_loaded and the memory budget: stop the least recently used idle
        unpinned engine, or mark the least recently used busy one draining and wait for it (bounded)."""
        deadline = self._clock() + self.room_wait_s
        while True:
            held = [x for x in self.entries.values() if x is not e and self._holds(x)]
            budget = self.memory_budget
            if budget is not None and e.size > budget:
                raise NoRoom(f"model {e.spec.name!r} needs {e.size / 1e9:.2f} GB, more than the memory "
                             f"budget ({budget / 1e9:.2f} GB) holds")
            fits = budget is None or sum(x.size for x in held) + e.size <= budget
            if len(held) < self.max_loaded and fits:
                e.has_room = True
                return
            idle = [x for x in held if x.state == "loaded" and x.running == 0 and not x.spec.pinned]
            if idle:
                await self._stop(min(idle, key=lambda x: x.last_used))
                continue
            busy = [x for x in held if x.state == "loaded" and not x.spec.pinned]
            if busy and not any(x.draining for x in busy):
                min(busy, key=lambda x: x.last_used).draining = True  # stops when its last request ends
            left = deadline - self._clock()
            if left <= 0:
                for x in held:
                    x.draining = False  # this load gives up: they serve on
                names = ", ".join(x.spec.name for x in held)
                raise NoRoom(f"model {e.spec.name!r} cannot load: the loaded models are busy ({names}) and "
                             "another does not fit beside them; raise --max-loaded-models or "
                             "--max-loaded-memory-gb, or retry")
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass

    @staticmethod
    def _holds(e: ModelEntry) -> bool:
        return e.state == "loaded" or (e.state == "loading" and e.has_room)

    def _detach(self, e: ModelEntry) -> Engine | None:
        # At once, before any await: a request arriving meanwhile must not get an engine being stopped.
        engine, e.engine, e.state, e.idle_since, e.draining = e.engine, None, "unloaded", None, False
        return engine

    async def _stop(self, e: ModelEntry) -> None:
        engine = self._detach(e)
        if engine is not None:
            await engine.stop()
        self._notify()

    def _stop_later(self, e: ModelEntry) -> None:
        engine = self._detach(e)
        if engine is None:
            return

        async def stop() -> None:
            await engine.stop()
            self._notify()

        task = asyncio.ensure_future(stop())
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    def _forget(self, e: ModelEntry) -> None:
        # Its requests still hold leases (they fail on their own and release them). Stopping a dead engine
        # is its bookkeeping only: the process reaped, the owner socket closed.
        self._stop_later(e)
        e.error = "its engine exited"
        self._notify()

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.ensure_future(wake())


def _why(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 2000 else text[-2000:]  # a child's last words can be long


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()

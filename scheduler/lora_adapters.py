"""The LoRA adapters the engine serves, by name, and the device slots they hold as their requests need them.

An adapter is registered (--lora-modules at start, LoadLora while serving) once its config and its weights'
shapes are checked against the model; each load under a name is a new generation, which the prefix cache
keys its KV by (protocol/lora.py's lora_key), so a reloaded adapter never meets its predecessor's KV. It
takes one of the --max-loras device slots when a request under it is admitted and it holds none: a free
slot, else the least recently used one that no running request's adapter holds (a running request's slot is
never taken); the next step tells the worker to fill it (SchedulerOutput.lora_loads). No slot to be had: the
request waits, and those behind it go on.

Unloading: the name is refused to new requests at once; with abort_running its requests fail; the adapter
goes when none of its requests is left, its slot freed and the worker told to forget its weights. An unload
that waits past its timeout fails (lora_busy) and the adapter stays.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.lora import LoraModule, check_lora_shapes, read_lora
from tandem.protocol.lora_messages import LoraReply, LoraSlotLoad, UnloadLora
from tandem.protocol.messages import RequestError
from tandem.protocol.model_config import ModelConfig, read_model_config
from tandem.scheduler.req import Req

NO_LORA = "this engine serves no LoRA adapters: start it with --enable-lora (or --lora-modules)"


@dataclass
class Adapter:
    name: str
    path: str
    generation: int
    slot: int | None = None  # its device slot, while it holds one
    last_used: int = 0  # when a request last took it (for the least recently used slot)


@dataclass
class Unloading:
    rid: str  # the UnloadLora call's
    deadline: float


def lora_of(adapters: LoraAdapters | None, name: str) -> tuple[str, int]:
    """A new request's adapter: (name, generation); InvalidRequestError if it is not served."""
    if adapters is None:
        raise InvalidRequestError(NO_LORA, ErrorCode.LORA)
    return name, adapters.serving(name).generation


class LoraAdapters:
    @staticmethod
    def for_engine(cfg: EngineConfig) -> LoraAdapters | None:
        """The engine's table, its --lora-modules registered (None: the engine serves no adapters)."""
        if not cfg.lora:
            return None
        table = LoraAdapters(cfg.max_loras, cfg.max_lora_rank, read_model_config(cfg.model))
        for m in map(LoraModule.parse, cfg.lora_modules):
            table.register(m.name, m.path)
        return table

    def __init__(self, slots: int, max_rank: int, model: ModelConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots: list[str | None] = [None] * slots  # device slot -> the adapter in it
        self.max_rank, self.model, self.clock = max_rank, model, clock
        self.adapters: dict[str, Adapter] = {}
        self.unloading: dict[str, Unloading] = {}
        self.generations: dict[str, int] = {}  # name -> its latest load's generation
        self.loads: list[LoraSlotLoad] = []  # for the next step sent
        self.forget: list[tuple[str, int]] = []
        self._tick = 0

    def register(self, name: str, path: str) -> Adapter:
        """Serve the adapter at path as name; a LoraError (ModelLoadError) names what is wrong with it."""
        if name in self.adapters:
            raise InvalidRequestError(f"an adapter is served as {name!r} already: unload it first",
                                      ErrorCode.LORA_CONFLICT)
        cfg = read_lora(LoraModule.parse(f"{name}={path}"), self.max_rank)
        check_lora_shapes(cfg, self.model)
        generation = self.generations[name] = self.generations.get(name, 0) + 1
        adapter = self.adapters[name] = Adapter(name, str(cfg.path), generation)
        return adapter

    def serving(self, name: str) -> Adapter:
        """The adapter a new request names; InvalidRequestError if none is served (or it is unloading)."""
        a = self.adapters.get(name)
        if a is None or name in self.unloading:
            served = ", ".join(n for n in self.adapters if n not in self.unloading) or "none"
            raise InvalidRequestError(f"no LoRA adapter {name!r} is served (served: {served})",
                                      ErrorCode.LORA)
        return a

    def served(self) -> dict[str, str]:
        """name -> path of every adapter new requests may name."""
        return {n: a.path for n, a in self.adapters.items() if n not in self.unloading}

    def acquire(self, req: Req, running: Iterable[Req]) -> int | None:
        """The device slot of req's adapter, taking one if it holds none; None: every slot is a running
        request's."""
        assert req.lora is not None
        a = self.adapters[req.lora]
        self._tick += 1
        a.last_used = self._tick
        if a.slot is not None:
            return a.slot
        free = [i for i, n in enumerate(self.slots) if n is None]
        if not free:
            busy = {r.lora for r in running}
            idle = [self.adapters[n] for n in self.slots if n is not None and n not in busy]
            if not idle:
                return None
            victim = min(idle, key=lambda x: x.last_used)
            free, victim.slot = [victim.slot], None  # type: ignore[list-item]
        a.slot = free[0]
        self.slots[a.slot] = a.name
        self.loads.append(LoraSlotLoad(a.slot, a.name, a.generation, a.path))
        return a.slot

    def unload(self, msg: UnloadLora, live: Iterable[Req]) -> list[Req]:
        """Begin unloading: the requests to fail now (with abort_running), none otherwise."""
        self.serving(msg.name)
        self.unloading[msg.name] = Unloading(msg.rid, self.clock() + msg.timeout_s)
        return [r for r in live if r.lora == msg.name and not r.finished()] if msg.abort_running else []

    def settle(self, live: Iterable[Req]) -> list[LoraReply | RequestError]:
        """The unloads that end now: those whose adapter has no request left, and those out of time."""
        if not self.unloading:
            return []
        used = {r.lora for r in live}
        out: list[LoraReply | RequestError] = []
        for name, u in list(self.unloading.items()):
            a = self.adapters[name]
            if name not in used:
                del self.unloading[name], self.adapters[name]
                if a.slot is not None:
                    self.slots[a.slot] = None
                self.forget.append((name, a.generation))
                out.append(LoraReply(u.rid, name, False, a.generation))
            elif self.clock() >= u.deadline:
                del self.unloading[name]
                out.append(RequestError(u.rid, ErrorCode.LORA_BUSY, f"adapter {name!r} still has requests "
                                        "running at the unload's timeout: it stays served"))
        return out

    def take_orders(self) -> tuple[list[LoraSlotLoad], list[tuple[str, int]]]:
        """The worker's orders for the next step: slots to fill, adapters to forget."""
        out = (self.loads, self.forget)
        self.loads, self.forget = [], []
        return out

"""Sans-IO routing of the engine's replies to the calls waiting on them, shared by Client and AsyncClient.

Each open request id has a sink (a callable that must not block: a queue's put). The router owns no
socket and no thread: the one I/O loop of each client feeds it what arrived and asks it what to abort.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tandem.protocol.errors import (
    EngineDeadError,
    ErrorCode,
    InvalidRequestError,
    TandemError,
    error_from_code,
)
from tandem.protocol.lora_messages import LoraReply
from tandem.protocol.messages import (
    EmbeddingBatch,
    EmbeddingOutput,
    EngineStats,
    FrontendMsg,
    OutputBatch,
    RequestError,
    RequestOutput,
    SessionReply,
)

log = logging.getLogger("tandem.client")

Item = RequestOutput | EmbeddingOutput | EngineStats | SessionReply | LoraReply | TandemError
Sink = Callable[[Item], None]


@dataclass
class _Entry:
    sink: Sink
    is_request: bool  # a generate request (abortable), not a query (stats, session calls)


class Router:
    def __init__(self) -> None:
        self._open: dict[str, _Entry] = {}
        self.dead: str | None = None  # why the engine is gone, once it is
        self.dead_code: str = ErrorCode.ENGINE_DEAD

    def __len__(self) -> int:
        return len(self._open)

    def open(self, rid: str, sink: Sink, is_request: bool = True) -> bool:
        """Register a call before its message is sent; False (and the sink told why) when it must not be."""
        if self.dead is not None:
            sink(EngineDeadError(self.dead, self.dead_code))
            return False
        if rid in self._open:  # this client's own calls; across clients the frontend checks
            sink(InvalidRequestError(f"request id {rid!r} is already in flight", ErrorCode.DUPLICATE_RID))
            return False
        self._open[rid] = _Entry(sink, is_request)
        return True

    def close(self, rid: str) -> bool:
        """The caller stopped listening. True when the request had not ended: the engine should abort it."""
        entry = self._open.pop(rid, None)
        return entry is not None and entry.is_request and self.dead is None

    def route(self, msg: FrontendMsg) -> None:
        if isinstance(msg, (OutputBatch, EmbeddingBatch)):
            for out in msg.outputs:
                entry = self._open.pop(out.rid, None) if out.finished else self._open.get(out.rid)
                if entry is not None:
                    entry.sink(out)
        elif isinstance(msg, (EngineStats, SessionReply, LoraReply)):
            entry = self._open.pop(msg.rid, None)
            if entry is not None:
                entry.sink(msg)
        elif isinstance(msg, RequestError):
            entry = self._open.pop(msg.rid, None)
            if entry is not None:
                entry.sink(error_from_code(msg.code, msg.message))
            else:  # e.g. a frame the frontend could not decode: no request to fail
                log.warning("engine error for no open request (%r): %s: %s", msg.rid, msg.code, msg.message)

    def fail_all(self, why: str, code: str = ErrorCode.ENGINE_DEAD) -> None:
        """The engine is gone (or the client closed): every open call ends with EngineDeadError."""
        if self.dead is None:
            self.dead, self.dead_code = why, code
        entries, self._open = self._open, {}
        for entry in entries.values():
            entry.sink(EngineDeadError(self.dead, self.dead_code))

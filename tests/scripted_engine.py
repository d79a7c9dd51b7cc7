"""The HTTP door without an engine: an AsyncClient stand-in whose replies are scripted, piece by piece, and
the FastAPI app on it reached through an in-process transport (no socket). For what a random model cannot
write: think markers, tool-call blocks, a stop sequence, cut in any pieces."""
from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.app import create_app
from tandem.frontend.http.metrics import Metrics
from tandem.frontend.http.response_store import ResponseStore
from tandem.frontend.http.state import ServerState
from tandem.frontend.reasoning_parser import template_style
from tandem.protocol.final_info import FinalInfo
from tandem.protocol.model_info import read_model_info
from tandem.protocol.tokenizer_loader import load_tokenizer

NAME = "scripted"
KEY = "sk-scripted"


@dataclass
class Reply:
    pieces: list[str]
    finish_reason: str = "stop"
    matched_stop: int | str | None = None
    cached_tokens: int = 0
    # raised before any output, as the engine reports a bad request (or a fault)
    error: Exception | None = None


@dataclass
class ScriptedEngine:
    replies: deque[Reply] = field(default_factory=deque)
    prompts: list[list[int]] = field(default_factory=list)  # every request's prompt ids, in order
    params: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    priorities: list[int] = field(default_factory=list)
    sessions: list[tuple[str, Any]] = field(default_factory=list)  # (rid, SessionParams or None) per call

    def script(self, *replies: Reply | list[str]) -> None:
        self.replies.extend(r if isinstance(r, Reply) else Reply(r) for r in replies)

    async def stream(self, prompt: Any, params: dict[str, Any], rid: str, priority: int = 0,
                     session: Any = None) -> AsyncIterator[CompletionDelta]:
        self.prompts.append(list(prompt))
        self.params.append(dict(params))
        self.priorities.append(priority)
        self.sessions.append((rid, session))
        r = self.replies.popleft() if self.replies else Reply(["ok"])
        if r.error is not None:
            raise r.error
        for i, piece in enumerate(r.pieces):
            last = i == len(r.pieces) - 1
            final = (
                FinalInfo(r.finish_reason, r.matched_stop, len(prompt), len(r.pieces), r.cached_tokens)
                if last
                else None
            )
            yield CompletionDelta(rid, piece, [i], final)

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def scripted_app(model: Path, reasoning: str | None, store: int = 8) -> tuple[ScriptedEngine, Any]:
    engine = ScriptedEngine()
    tok = load_tokenizer(model)
    if reasoning == "auto":  # as the HTTP process resolves it
        reasoning = template_style(tok.chat_template)
    st = ServerState(engine, tok, read_model_info(model, None), str(model), NAME, Metrics(NAME), KEY,  # type: ignore[arg-type]
                     reasoning, ResponseStore(store))
    return engine, create_app(st)


def transport(app: Any) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://scripted", timeout=30)

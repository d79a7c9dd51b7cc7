"""The HTTP door without an engine: an AsyncClient stand-in whose replies are scripted, piece by piece, and
the FastAPI app on it reached through an in-process transport (no socket). For what a random model cannot
write: think markers, tool-call blocks, a stop sequence, cut in any pieces. A reply scripted as token ids
goes through the engine's own detokenizer (registered as the scheduler registers a request), so the text
is what the engine would send for those tokens."""
from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from tandem.detokenizer.process import Detokenizer
from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.app import create_app
from tandem.frontend.http.metrics import Metrics
from tandem.frontend.http.response_store import ResponseStore
from tandem.frontend.http.state import ServerState
from tandem.frontend.reasoning_parser import template_style
from tandem.protocol.final_info import FinalInfo
from tandem.protocol.messages import DetokRegister, TokenBatch, TokenDelta
from tandem.protocol.model_info import read_model_info
from tandem.protocol.tokenizer_loader import load_fast_tokenizer, load_tokenizer
from tests.wire_schema import Recorder

NAME = "scripted"
KEY = "sk-scripted"


@dataclass
class Reply:
    pieces: list[str] | list[list[int]]  # text, or token ids (a list per engine output)
    finish_reason: str = "stop"
    matched_stop: int | str | None = None
    cached_tokens: int = 0
    # raised before any output, as the engine reports a bad request (or a fault)
    error: Exception | None = None
    fault: Exception | None = None  # raised after the pieces (none of them final): a fault mid-reply


@dataclass
class ScriptedEngine:
    tokenizer: Any = None  # the `tokenizers` one the detokenizer uses, for replies scripted as token ids
    replies: deque[Reply] = field(default_factory=deque)
    prompts: list[list[int]] = field(default_factory=list)  # every request's prompt ids, in order
    params: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    priorities: list[int] = field(default_factory=list)
    sessions: list[tuple[str, Any]] = field(default_factory=list)  # (rid, SessionParams or None) per call

    def script(self, *replies: Reply | list[str]) -> None:
        self.replies.extend(r if isinstance(r, Reply) else Reply(r) for r in replies)

    loras: list[str | None] = field(default_factory=list)  # the adapter each request named (None: the base)
    served_loras: dict[str, str] = field(default_factory=dict)  # what stats() says is served: name -> path

    async def stats(self) -> Any:
        """The engine's answer to the HTTP server's question which adapters it serves."""
        from types import SimpleNamespace

        return SimpleNamespace(loras=dict(self.served_loras))

    async def stream(self, prompt: Any, params: dict[str, Any], rid: str, priority: int = 0,
                     session: Any = None, lora: str | None = None) -> AsyncIterator[CompletionDelta]:
        self.loras.append(lora)
        self.prompts.append(list(prompt))
        self.params.append(dict(params))
        self.priorities.append(priority)
        self.sessions.append((rid, session))
        r = self.replies.popleft() if self.replies else Reply(["ok"])
        if r.error is not None:
            raise r.error
        detok = None
        if r.pieces and not isinstance(r.pieces[0], str):
            detok = Detokenizer(self.tokenizer)
            # The scheduler's registration: the prompt's last 8 ids as decode context.
            detok.register(DetokRegister(rid, list(prompt)[-8:], params.get("skip_special_tokens", True),
                                         params.get("stop") or []))
        n_out = sum(len(p) for p in r.pieces) if detok is not None else len(r.pieces)
        for i, piece in enumerate(r.pieces):
            last = i == len(r.pieces) - 1 and r.fault is None
            final = (
                FinalInfo(r.finish_reason, r.matched_stop, len(prompt), n_out, r.cached_tokens) if last else None
            )
            if isinstance(piece, str):
                yield CompletionDelta(rid, piece, [i], final)
            else:
                assert detok is not None
                out = detok.process(TokenBatch([TokenDelta(rid, piece, final)])).outputs[0]
                yield CompletionDelta(rid, out.text, piece, final)
        if r.fault is not None:
            raise r.fault

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def scripted_app(model: Path, reasoning: str | None, store: int = 8) -> tuple[ScriptedEngine, Any]:
    engine = ScriptedEngine(load_fast_tokenizer(model))
    tok = load_tokenizer(model)
    if reasoning == "auto":  # as the HTTP process resolves it
        reasoning = template_style(tok.chat_template)
    st = ServerState(engine, tok, read_model_info(model, None), str(model), NAME, Metrics(NAME), KEY,  # type: ignore[arg-type]
                     reasoning, ResponseStore(store))
    return engine, create_app(st)


class _CheckedClient(httpx2.AsyncClient):
    """On a clean exit from its `async with`, every Responses and Messages body it got (whole, streamed,
    errors) is held strictly to the official SDKs' types (tests/wire_schema.py): the SDKs themselves read
    leniently, so a test through them alone would pass a body off the published schema."""

    def __init__(self, app: Any) -> None:
        self.recorder = Recorder(httpx2.ASGITransport(app=app))
        super().__init__(transport=self.recorder, base_url="http://scripted", timeout=30)

    async def __aexit__(self, *exc: Any) -> None:
        await super().__aexit__(*exc)
        if exc[0] is None:
            self.recorder.check()


def transport(app: Any) -> httpx2.AsyncClient:
    return _CheckedClient(app)

"""Bounds at the HTTP door, so that no client can grow the server's memory without limit (docs/limits.md).

- A request body over `max_body_bytes` gets 413 in the route's error shape (OpenAI's, Anthropic's): at once
when Content-Length says
  so (nothing is read), else as soon as the bytes received pass the limit. The body is read here, up to the
  limit, and handed to the app as one message (the app would read it whole anyway).
- At most `max_concurrent` generation (and embedding) requests are served at once; past it they get 503
`overloaded`
  before anything is tokenized or sent to the engine. A streamed request counts until its response is
  written, so clients that stop reading hold their places and cannot make the server take more.

A pure ASGI middleware: Starlette's BaseHTTPMiddleware would buffer streamed responses.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tandem.frontend.http.errors import APIError
from tandem.protocol.errors import ErrorCode

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                              "/v1/embeddings", "/api/chat", "/api/generate", "/api/embed"})
_OVER = b"<over the limit>"  # a sentinel, compared by identity


class DoorLimits:
    def __init__(self, app: App, max_body_bytes: int, max_concurrent: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent
        self.active = 0  # generation requests being served now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        path = scope.get("path", "")
        if length is not None and length > self.max_body_bytes:
            await _reject(send, path, 413, self._too_large(f"{length} bytes"), ErrorCode.TOO_LARGE)
            return
        body = await self._read_body(receive)
        if body is None:  # the client left while sending
            return
        if body is _OVER:
            await _reject(
                send,
                path,
                413,
                self._too_large(f"more than {self.max_body_bytes} bytes"),
                ErrorCode.TOO_LARGE,
            )
            return
        gated = path in GENERATION_PATHS
        if gated and self.active >= self.max_concurrent:
            why = f"{self.max_concurrent} requests are being served already (--max-concurrent-requests)"
            await _reject(send, path, 503, why, ErrorCode.OVERLOADED)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as the app expects

        self.active += gated
        try:
            await self.app(scope, replay, send)
        finally:
            self.active -= gated

    def _too_large(self, size: str) -> str:
        return (
            f"request body of {size} is over the limit of {self.max_body_bytes} bytes (--max-request-bytes)"
        )

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body; _OVER as soon as it passes the limit (the rest is not read); None on disconnect."""
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return _OVER
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reject(send: Send, path: str, status: int, message: str, code: str) -> None:
    payload = APIError(status, message, None, code).response(path).body  # the route's own error shape
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})

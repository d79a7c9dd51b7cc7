"""Server-sent events, and running a request's choices with an eye on the client's connection."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.choices import ChoiceRun
from tandem.frontend.http.errors import APIError, from_engine
from tandem.protocol.errors import TandemError

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def sse(obj: dict, event: str | None = None) -> bytes:
    """One event; named (`event: NAME`) as the Responses and Messages APIs send theirs."""
    head = b"event: " + event.encode() + b"\n" if event is not None else b""
    return head + b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def openai_error_event(err: APIError) -> bytes:
    return sse({"error": {"message": err.message, "type": "error", "param": None, "code": err.code}})


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.2) -> T:
    """Await work; if the client goes away first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def stream_response(
    request: Request, run: ChoiceRun,
    chunks: Callable[[AsyncIterator[tuple[int, CompletionDelta]]], AsyncIterator[bytes]],
    error_event: Callable[[APIError], bytes] = openai_error_event, done: bytes | None = DONE,
) -> StreamingResponse:
    """An SSE response of `chunks` over the run, then `done`. The first output is awaited before
    answering, so an error the engine reports up front (a bad parameter) is an HTTP error status, not a
    stream; a client that leaves while its request waits for that first output aborts it too. A later
    engine error is the stream's last event, in the API's shape (`error_event`)."""
    it = run.__aiter__()
    first = await until_disconnect(request, it.__anext__())

    async def deltas() -> AsyncIterator[tuple[int, CompletionDelta]]:
        yield first
        async for x in it:
            yield x

    async def body() -> AsyncIterator[bytes]:
        try:
            async for b in chunks(deltas()):
                yield b
        except TandemError as e:
            yield error_event(from_engine(e))
        finally:
            await it.aclose()  # the client may be gone: abort what is left
        if done is not None:
            yield done

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

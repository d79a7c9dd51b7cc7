"""Server-sent events, and running a request's choices with an eye on the client's connection."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from frontend.completion import CompletionDelta
from frontend.http.choices import ChoiceRun
from frontend.http.errors import from_engine
from protocol.errors import TandemError

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


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
) -> StreamingResponse:
    """An SSE response of `chunks` over the run. The first output is awaited before answering, so an
    error the engine reports up front (a bad parameter) is an HTTP error status, not a stream; a client
    that leaves while its request waits for that first output aborts it too."""
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
            err = from_engine(e)
            yield sse({"error": {"message": err.message, "type": "error", "param": None, "code": err.code}})
        finally:
            await it.aclose()  # the client may be gone: abort what is left
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

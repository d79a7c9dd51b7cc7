"""Running one API request's choices (n prompts x n samples) as engine requests, merged into one stream.

Whatever way the consumer stops (finished, error, client gone, cancelled), every engine request that
has not finished is aborted, so a disconnect frees its KV at once. The pumps keep reading until the
engine's final (abort) output, so the metrics see every request end.

Outputs wait here until the response writes them; a client that stops reading (its socket buffers full)
would let them pile up, so past MAX_UNREAD_OUTPUTS the run is aborted, typed (docs/limits.md).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tandem.frontend.client.async_client import AsyncClient
from tandem.frontend.client.request_encoding import Prompt
from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.metrics import Metrics
from tandem.protocol.errors import ErrorCode, RequestFailedError, TandemError
from tandem.protocol.messages import SessionParams

logger = logging.getLogger(__name__)
MAX_UNREAD_OUTPUTS = 1024  # per HTTP request, all its choices together


class ChoiceRun:
    """choices[i] runs prompts[i] with params[i]; iterate for (index, delta) as they arrive. rids: the engine
    request ids (default: fresh ones); session: the session all of them continue; lora: the adapter they
    run under."""

    def __init__(self, client: AsyncClient, metrics: Metrics, prompts: Sequence[Prompt],
                 params: Sequence[dict[str, Any]], priority: int = 0, session: SessionParams | None = None,
                 rids: list[str] | None = None, lora: str | None = None) -> None:
        self.client, self.metrics = client, metrics
        self.priority, self.session, self.lora = priority, session, lora
        base = uuid.uuid4().hex
        self.rids = rids or [f"{base}-{i}" for i in range(len(prompts))]
        self._unfinished = set(self.rids)
        self._closing = False
        self._queue: asyncio.Queue[tuple[int, CompletionDelta | TandemError]] = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._pump(i, p, sp)) for i, (p, sp) in enumerate(zip(prompts, params))
        ]

    async def _pump(self, i: int, prompt: Prompt, params: dict[str, Any]) -> None:
        last: float | None = None
        if self._closing:
            return  # closed before this choice was submitted: nothing to abort later
        unread = False  # past MAX_UNREAD_OUTPUTS: aborted, the rest dropped
        try:
            async for d in self.client.stream(prompt, params, self.rids[i], priority=self.priority,
                                              session=self.session, lora=self.lora):
                last = self.metrics.on_delta(d, last)
                if d.finished:
                    self._unfinished.discard(self.rids[i])
                elif not unread and self._queue.qsize() >= MAX_UNREAD_OUTPUTS:
                    unread = True
                    await self.client.abort(self.rids[i])  # read on: its final (abort) output ends the loop
                if not unread:
                    await self._queue.put((i, d))
            if unread:
                why = f"the client left {MAX_UNREAD_OUTPUTS} outputs of this request unread: it was aborted"
                await self._queue.put((i, RequestFailedError(why, ErrorCode.CLIENT_NOT_READING)))
        except TandemError as e:
            self._unfinished.discard(self.rids[i])  # the engine ended it already
            await self._queue.put((i, e))
        except Exception as e:  # a fault of ours: the response still ends (a typed 500), never waits forever
            logger.exception("choice %s of a request failed", i)
            await self._queue.put((i, RequestFailedError(f"internal error: {type(e).__name__}: {e}",
                                                         ErrorCode.FAILED_INTERNAL)))

    async def __aiter__(self) -> AsyncIterator[tuple[int, CompletionDelta]]:
        done = 0
        try:
            while done < len(self.rids):
                i, item = await self._queue.get()
                if isinstance(item, TandemError):
                    raise item
                if item.finished:
                    done += 1
                yield i, item
        finally:
            await asyncio.shield(self.close())

    async def close(self) -> None:
        self._closing = True
        for rid in list(self._unfinished):
            self._unfinished.discard(rid)
            try:
                await self.client.abort(rid)
            except TandemError:
                pass  # the engine is gone: nothing left to free

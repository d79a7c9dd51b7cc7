"""The synchronous Python client: `Client(endpoint)` or `Client.launch(model_dir, **engine_options)`.

A thin shell over AsyncClient, which lives on this client's own event-loop thread: each method hands the
async one to that loop and waits, so the two clients share every line of request handling and cannot drift.
Thread-safe: only the loop touches the socket, and any number of threads may call generate, stream,
generate_batch, abort, stats and drain on one Client. A call that stops listening (a stream left early, an
exception, an error in generate_batch) aborts its requests in the engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import subprocess
import threading
import weakref
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from tandem.frontend.client.async_client import CLOSED, SESSION_TIMEOUT_S, AsyncClient
from tandem.frontend.client.connection import CONNECT_TIMEOUT_S
from tandem.frontend.client.engine_process import prompt_model, start_engine_process
from tandem.frontend.client.request_encoding import Params, Prompt
from tandem.frontend.client.session import Session
from tandem.frontend.completion import Completion, CompletionDelta
from tandem.frontend.embedding import Embedding
from tandem.frontend.reasoning_parser import check_style
from tandem.protocol.engine_stats import EngineStats
from tandem.protocol.errors import EngineDeadError
from tandem.protocol.messages import SessionParams

T = TypeVar("T")


class Client:
    """`connect_timeout_s`: as AsyncClient's (an engine must answer within it, else calls raise
    EngineDeadError, code engine_dead.unreachable)."""

    def __init__(
        self,
        endpoint: str,
        *,
        engine: subprocess.Popen | None = None,
        reasoning_parser: str | None = None,
        connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
        model: str | None = None,
    ) -> None:
        """model: as AsyncClient's (chat messages with images need it)."""
        check_style(reasoning_parser, allow_auto=False)
        self.endpoint = endpoint
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-client-io", daemon=True)
        self._thread.start()
        # A client collected unclosed stops its thread; the AsyncClient, then collected too, closes its
        # sockets.
        self._stop_loop = weakref.finalize(self, _stop_loop, self._loop)
        self._stop_loop.atexit = False  # at exit the process frees it all; nothing to stop or close
        self._lock = threading.Lock()  # orders "hand the loop a call" against "close": no call is stranded
        self._closed = False
        # Its sockets belong to the loop.
        try:
            self._async: AsyncClient = self._run(
                _on_loop(endpoint, engine, reasoning_parser, connect_timeout_s, model)
            )
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def launch(cls, model: str, *, reasoning_parser: str | None = None,
               connect_timeout_s: float | None = CONNECT_TIMEOUT_S, **engine_options: object) -> Client:
        """Start an engine this client owns; it stops on close(), at the end of a `with` block, or when
        this process dies. `reasoning_parser` (qwen3 or deepseek-r1) splits each Completion's
        `reasoning_text` from its `content`."""
        check_style(reasoning_parser, allow_auto=False)
        proc, endpoint = start_engine_process(model, **engine_options)
        return cls(endpoint, engine=proc, reasoning_parser=reasoning_parser,
                   connect_timeout_s=connect_timeout_s, model=prompt_model(model, engine_options))

    def generate(self, prompt: Prompt, params: Params = None, request_id: str | None = None, *,
                 priority: int = 0, session: SessionParams | None = None, lora: str | None = None,
                 ) -> Completion:
        """priority: lower is served first (under --scheduling-policy priority). session: continue a
        session's turn (simpler through open_session()). lora: run under that adapter (--lora-modules)."""
        return self._run(self._async.generate(prompt, params, request_id, priority=priority, session=session,
                                              lora=lora))

    def stream(
        self,
        prompt: Prompt,
        params: Params = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        session: SessionParams | None = None,
        lora: str | None = None,
    ) -> Iterator[CompletionDelta]:
        deltas = self._async.stream(prompt, params, request_id, priority=priority, session=session, lora=lora)
        try:
            while True:
                try:
                    delta = self._run(deltas.__anext__())
                except StopAsyncIteration:
                    return
                yield delta
        finally:  # left early (break, exception, garbage collection): the async stream's own exit aborts
            with contextlib.suppress(EngineDeadError):  # not on a closed client: nothing runs any more
                self._submit(deltas.aclose())  # not waited for: this may run on any thread, the loop's too

    def generate_batch(
        self, prompts: Sequence[Prompt], params: Params | Sequence[Params] = None, progress: bool = True,
        priority: int = 0,
    ) -> list[Completion]:
        """All at once; the first error raises, and aborts the rest of the batch."""
        return self._run(self._async.generate_batch(prompts, params, progress, priority))

    def embed(
        self, input: str | Sequence[int], *, dimensions: int | None = None, normalize: bool = True,
        request_id: str | None = None, priority: int = 0,
    ) -> Embedding:
        """The model's final hidden states over `input` (text or token ids), pooled as the engine's --pooling
        says and L2-normalized unless told not to; `dimensions` keeps a Matryoshka model's first values."""
        return self._run(
            self._async.embed(
                input, dimensions=dimensions, normalize=normalize, request_id=request_id, priority=priority
            )
        )

    def embed_batch(
        self, inputs: Sequence[str | Sequence[int]], *, dimensions: int | None = None, normalize: bool = True,
        priority: int = 0,
    ) -> list[Embedding]:
        """All at once, batched by the engine; the first error raises, and aborts the rest."""
        return self._run(self._async.embed_batch(inputs, dimensions=dimensions, normalize=normalize,
                                                 priority=priority))

    def stats(self, timeout_s: float = 30.0) -> EngineStats:
        """The engine's counters; the scheduler runs its integrity check to answer."""
        return self._run(self._async.stats(timeout_s))

    def drain(self, reason: str = "a client asked for a drain", timeout_s: float = 30.0) -> EngineStats:
        """Drain the engine as SIGTERM does (running requests finish, new ones are refused, then it stops)."""
        return self._run(self._async.drain(reason, timeout_s))

    def open_session(self, capacity_tokens: int, timeout_s: float = SESSION_TIMEOUT_S) -> Session:
        """A session: requests through it continue a turn's full context from the KV the engine holds
        for it (up to capacity_tokens), until it is closed or idle for timeout_s. A context manager."""
        opened = self._run(self._async.open_session(capacity_tokens, timeout_s))
        return Session(self, opened.id)

    def close_session(self, session_id: str) -> None:
        self._run(self._async.close_session(session_id))

    def load_lora(self, name: str, path: str) -> int:
        """Serve the adapter at `path` (PEFT directory or GGUF file) as `name` (AsyncClient.load_lora): its
        generation."""
        return self._run(self._async.load_lora(name, path))

    def unload_lora(self, name: str, *, abort_running: bool = False, timeout_s: float = 30.0) -> None:
        """Stop serving `name` (AsyncClient.unload_lora)."""
        self._run(self._async.unload_lora(name, abort_running=abort_running, timeout_s=timeout_s))

    def abort(self, request_id: str) -> None:
        """Stop a request this client submitted; its call ends with finish_reason "abort"."""
        self._run(self._async.abort(request_id))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_loop.detach()
        asyncio.run_coroutine_threadsafe(_shut_down(self._async), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if not self._closed:
                return asyncio.run_coroutine_threadsafe(coro, self._loop)
        coro.close()
        raise EngineDeadError(CLOSED)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = self._submit(coro)
        try:
            return fut.result()
        finally:
            fut.cancel()  # a no-op once done; interrupted (Ctrl-C): the call stops, and aborts, on the loop


async def _on_loop(endpoint: str, engine: subprocess.Popen | None, reasoning_parser: str | None,
                   connect_timeout_s: float | None, model: str | None) -> AsyncClient:
    return AsyncClient(endpoint, engine=engine, reasoning_parser=reasoning_parser,
                       connect_timeout_s=connect_timeout_s, model=model)


async def _shut_down(client: AsyncClient) -> None:
    """Close, then let every call still on the loop finish (closing failed them) before the loop stops."""
    await client.close()
    await asyncio.get_running_loop().shutdown_asyncgens()  # streams left suspended: no abort, nothing runs
    others = asyncio.all_tasks() - {asyncio.current_task()}
    await asyncio.gather(*others, return_exceptions=True)


def _stop_loop(loop: asyncio.AbstractEventLoop) -> None:
    with contextlib.suppress(RuntimeError):  # closed already (interpreter exit)
        loop.call_soon_threadsafe(loop.stop)

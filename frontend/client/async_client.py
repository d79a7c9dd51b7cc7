"""The asyncio client, and the one implementation of the client API (Client is its sync shell).

The socket lives in the event loop: plain (non-asyncio) ZMQ sockets whose file descriptors the loop watches
with add_reader, so a step's output costs one callback that drains the socket, not a poller's futures per
wake-up (what the HTTP door pays per token). Sends happen inline: the DEALER has no send limit. A call that
stops listening (a stream left early, a cancelled task, an error in generate_batch) aborts its requests in
the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq
from tqdm import tqdm

from tandem.frontend.client.adapter_calls import AdapterCalls
from tandem.frontend.client.connection import (
    CONNECT_TIMEOUT_S,
    DeathWatch,
    decode_msg,
    encode_msg,
    engine_exit_reason,
    open_dealer,
    release,
)
from tandem.frontend.client.engine_process import prompt_model, start_engine_process, stop_engine_process
from tandem.frontend.client.request_encoding import (
    Params,
    Prompt,
    build_embed_request,
    build_request,
    new_rid,
    params_per_prompt,
    split_images,
)
from tandem.frontend.client.router import Item, Router
from tandem.frontend.completion import Completion, CompletionDelta, to_delta
from tandem.frontend.embedding import Embedding
from tandem.frontend.image_prompt import ImagePrompter
from tandem.frontend.reasoning_parser import check_style
from tandem.protocol.embed_params import EmbedParams
from tandem.protocol.errors import EngineDeadError, ErrorCode, InvalidRequestError, TandemError
from tandem.protocol.image_item import ImagePrompt
from tandem.protocol.ipc import ready_frames, ready_multipart
from tandem.protocol.lora_messages import LoadLora, LoraReply, UnloadLora
from tandem.protocol.messages import (
    AbortRequest,
    CloseSession,
    EmbeddingOutput,
    EngineStats,
    OpenSession,
    RequestOutput,
    SessionParams,
    SessionReply,
    StatsRequest,
)
from tandem.protocol.session_messages import MAX_SESSION_TOKENS
from tandem.protocol.stop_messages import DrainRequest

if TYPE_CHECKING:
    from tandem.frontend.client.session import AsyncSession

log = logging.getLogger("tandem.client")

CLOSED = "client is closed"
SESSION_TIMEOUT_S = 600.0  # an open session's default idle timeout


LAST_WORDS_MS = 100  # a lost engine's last messages may trail its disconnect event: waited for this long


class AsyncClient(AdapterCalls):
    """`connect_timeout_s`: an engine must answer at `endpoint` within this many seconds of the client's
    creation, else every call raises EngineDeadError (code engine_dead.unreachable) naming the endpoint;
    None waits as long as it takes. Once connected, the connection is the liveness signal (see README)."""

    def __init__(
        self,
        endpoint: str,
        *,
        engine: subprocess.Popen | None = None,
        reasoning_parser: str | None = None,
        connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
        model: str | None = None,
    ) -> None:
        """model: the engine's model (a directory), to send chat messages with images: each is made
        ready here, through its processor, off the event loop (launch() knows it)."""
        check_style(reasoning_parser, allow_auto=False)  # the client has no chat template to read `auto` from
        self._prompter = None if model is None else ImagePrompter(model)
        self._death = DeathWatch(endpoint, connect_timeout_s)  # first: a bad bound fails before any socket
        self.endpoint = endpoint
        self.reasoning_parser = reasoning_parser
        self._engine = engine
        self._ctx = zmq.Context()
        self._sock, self._monitor = open_dealer(self._ctx, endpoint)
        # By close(), or when this client is collected unclosed (a caller who forgot it): never by the
        # collector.
        self._release = weakref.finalize(self, release, self._ctx, self._sock, self._monitor)
        self._release.atexit = False  # at exit the process frees it all; nothing to stop or close
        self._router = Router()
        self._loop: asyncio.AbstractEventLoop | None = None  # set when the first call starts the I/O
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    @classmethod
    def launch(cls, model: str, *, reasoning_parser: str | None = None,
               connect_timeout_s: float | None = CONNECT_TIMEOUT_S, **engine_options: object) -> AsyncClient:
        """Start an engine this client owns; it stops on close(), at the end of a `with` block, or when
        this process dies."""
        check_style(reasoning_parser, allow_auto=False)
        proc, endpoint = start_engine_process(model, **engine_options)
        return cls(endpoint, engine=proc, reasoning_parser=reasoning_parser,
                   connect_timeout_s=connect_timeout_s, model=prompt_model(model, engine_options))

    async def generate(self, prompt: Prompt, params: Params = None, request_id: str | None = None, *,
                       priority: int = 0, session: SessionParams | None = None, lora: str | None = None,
                       ) -> Completion:
        """priority: lower is served first (under --scheduling-policy priority). session: continue a
        session's turn (see open_session). lora: run under the LoRA adapter of that name (--lora-modules)."""
        prompt = await self._with_images(prompt)
        rid, items = self._submit(prompt, params, request_id, priority, session, lora)
        comp = Completion(rid, reasoning_style=self.reasoning_parser)
        async for out in self._outputs(rid, items):
            comp.add(out)
        return comp

    async def stream(
        self, prompt: Prompt, params: Params = None, request_id: str | None = None, *, priority: int = 0,
        session: SessionParams | None = None, lora: str | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        prompt = await self._with_images(prompt)
        rid, items = self._submit(prompt, params, request_id, priority, session, lora)
        async for out in self._outputs(rid, items):
            yield to_delta(out)

    async def generate_batch(
        self, prompts: Sequence[Prompt], params: Params | Sequence[Params] = None, progress: bool = True,
        priority: int = 0,
    ) -> list[Completion]:
        """All at once; the first error raises, and aborts the rest of the batch."""
        plist = params_per_prompt(prompts, params)
        bar = tqdm(total=len(prompts), disable=not progress, desc="generate")

        async def one(p: Prompt, sp: Params) -> Completion:
            c = await self.generate(p, sp, priority=priority)
            bar.update(1)
            return c

        tasks = [asyncio.ensure_future(one(p, sp)) for p, sp in zip(prompts, plist)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # gather leaves the others running after an error: stop (and abort) them
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()

    async def embed(
        self, input: str | Sequence[int], *, dimensions: int | None = None, normalize: bool = True,
        request_id: str | None = None, priority: int = 0,
    ) -> Embedding:
        """The model's final hidden states over `input` (text or token ids), pooled as the engine's --pooling
        says and L2-normalized unless told not to; `dimensions` keeps a Matryoshka model's first values."""
        req = build_embed_request(input, EmbedParams(dimensions=dimensions, normalize=normalize), request_id,
                                  priority)
        outs = [
            o async for o in self._outputs(req.rid, self._open(req.rid, encode_msg(req), is_request=True))
        ]
        assert len(outs) == 1 and isinstance(outs[0], EmbeddingOutput)  # one output, the final one
        return Embedding.of(outs[0])

    async def embed_batch(
        self, inputs: Sequence[str | Sequence[int]], *, dimensions: int | None = None, normalize: bool = True,
        priority: int = 0,
    ) -> list[Embedding]:
        """All at once, batched by the engine; the first error raises, and aborts the rest."""
        if isinstance(inputs, str):
            raise InvalidRequestError("embed_batch takes a list of inputs; embed takes one string")
        kw = {"dimensions": dimensions, "normalize": normalize, "priority": priority}
        tasks = [asyncio.ensure_future(self.embed(x, **kw)) for x in inputs]  # type: ignore[arg-type]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stats(self, timeout_s: float = 30.0) -> EngineStats:
        """The engine's counters; the scheduler runs its integrity check to answer."""
        rid = new_rid()
        item = await self._query(rid, StatsRequest(rid), timeout_s)
        assert isinstance(item, EngineStats)
        return item

    async def drain(self, reason: str = "a client asked for a drain", timeout_s: float = 30.0) -> EngineStats:
        """Drain the engine as SIGTERM does: running requests finish (within its --drain-timeout-s), new
        ones are refused (EngineDeadError, code engine_dead.draining), then it stops. Returns its stats."""
        rid = new_rid()
        item = await self._query(rid, DrainRequest(rid, reason), timeout_s)
        assert isinstance(item, EngineStats)
        return item

    async def open_session(self, capacity_tokens: int, timeout_s: float = SESSION_TIMEOUT_S) -> AsyncSession:
        """A session: requests through it continue a turn's full context from the KV the engine holds
        for it (up to capacity_tokens), until it is closed or idle for timeout_s. Use it as a context
        manager to close it."""
        from tandem.frontend.client.session import AsyncSession

        if (
            isinstance(capacity_tokens, bool)
            or not isinstance(capacity_tokens, int)
            or not 1 <= capacity_tokens <= MAX_SESSION_TOKENS
        ):  # past it the message cannot even be encoded
            raise InvalidRequestError(f"capacity_tokens must be an int in [1, {MAX_SESSION_TOKENS}], got "
                                      f"{capacity_tokens!r}", ErrorCode.SESSION)
        rid = new_rid()
        reply = await self._query(rid, OpenSession(rid, capacity_tokens, timeout_s))
        assert isinstance(reply, SessionReply)
        return AsyncSession(self, reply.session_id)

    async def close_session(self, session_id: str) -> None:
        """Close a session: the KV it holds goes back to the pool. A closed or unknown id is an error."""
        rid = new_rid()
        await self._query(rid, CloseSession(rid, session_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request this client submitted; its call ends with finish_reason "abort"."""
        self._check_alive()
        self._send(encode_msg(AbortRequest(request_id)))

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._loop is not None:
                self._loop.remove_reader(self._sock.FD)
                self._loop.remove_reader(self._monitor.FD)
            self._router.fail_all(CLOSED)
            self._release()
        if self._engine is not None:
            await asyncio.to_thread(stop_engine_process, self._engine)
            self._engine = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- internals (all on the event loop's thread) ------------------------------------------------
    async def _with_images(self, prompt: Prompt) -> Prompt:
        split = split_images(prompt)
        if split is None:
            return prompt
        if self._prompter is None:
            raise InvalidRequestError("chat messages with images need the engine's model: "
                                      "AsyncClient(endpoint, model=DIR) or launch()", ErrorCode.IMAGE)
        return ImagePrompt(*await asyncio.to_thread(self._prompter.prompt, *split))

    def _submit(self, prompt: Prompt, params: Params, rid: str | None, priority: int = 0,
                session: SessionParams | None = None, lora: str | None = None,
                ) -> tuple[str, asyncio.Queue[Item]]:
        req = build_request(prompt, params, rid, priority, session)
        req.lora = lora
        return req.rid, self._open(req.rid, encode_msg(req), is_request=True)

    async def _query(self, rid: str, msg: StatsRequest | DrainRequest | OpenSession | CloseSession | LoadLora
                     | UnloadLora, timeout_s: float = 30.0) -> EngineStats | SessionReply | LoraReply:
        """A call the scheduler answers at once: its reply, or its typed error raised."""
        items = self._open(rid, encode_msg(msg), is_request=False)
        try:
            item = await asyncio.wait_for(items.get(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply to {type(msg).__name__}") from None
        finally:
            self._router.close(rid)
        if isinstance(item, TandemError):
            raise item
        assert isinstance(item, (EngineStats, SessionReply, LoraReply))
        return item

    def _open(self, rid: str, frame: bytes, is_request: bool) -> asyncio.Queue[Item]:
        self._check_alive()
        items: asyncio.Queue[Item] = asyncio.Queue()
        if self._router.open(rid, items.put_nowait, is_request):
            self._send(frame)
        return items

    def _send(self, frame: bytes) -> None:
        if self._loop is None:  # the I/O starts with the first call, inside the loop
            self._start_io()
        if self._router.dead is None:
            self._sock.send(frame, zmq.NOBLOCK)  # SNDHWM 0: queued, never refused
            # ZMQ's descriptor is edge-triggered and a send can take the edge of a message that arrived
            # meanwhile: look once more, after this callback.
            assert self._loop is not None
            self._loop.call_soon(self._on_readable)

    def _start_io(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        loop.add_reader(self._sock.FD, self._on_readable)
        loop.add_reader(self._monitor.FD, self._on_readable)
        self._tasks = [loop.create_task(self._watch())]
        if self._death.deadline is not None and not self._death.connected:  # look again when it passes
            loop.call_later(max(0.0, self._death.deadline - self._death.clock()) + 0.01, self._on_readable)

    async def _outputs(
        self, rid: str, items: asyncio.Queue[Item]
    ) -> AsyncIterator[RequestOutput | EmbeddingOutput]:
        done = False
        try:
            while not done:
                item = await items.get()
                if isinstance(item, TandemError):
                    done = True
                    raise item
                assert isinstance(item, (RequestOutput, EmbeddingOutput))
                done = item.finished
                yield item
        finally:
            # Left early (break, exception, cancellation, garbage collection): nothing runs for nobody.
            if not done and self._router.close(rid) and not self._closed:
                self._send(encode_msg(AbortRequest(rid)))

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError(CLOSED)
        if self._router.dead is None:
            self._watch_connection()
        why = self._router.dead or engine_exit_reason(self._engine)
        if why is not None:
            self._router.fail_all(why)
            raise EngineDeadError(self._router.dead or why, self._router.dead_code)

    def _on_readable(self) -> None:
        if self._router.dead is not None or self._closed:
            # Unread frames would keep the descriptor readable and this callback spinning.
            if self._loop is not None and not self._closed:
                self._loop.remove_reader(self._sock.FD)
                self._loop.remove_reader(self._monitor.FD)
            return
        self._receive()
        # after draining the socket, so a typed reason the frontend sent on its way down wins
        self._watch_connection()

    def _watch_connection(self) -> None:
        """The monitor's events, then the connect deadline: the engine lost, or never reached in time."""
        for event in ready_multipart(self._monitor):
            if self._death.is_dead(event):
                # The monitor's event and the frontend's last words (why it stops) come on two sockets, in
                # no set order: what it sent before it went is read first, briefly waited for.
                with contextlib.suppress(zmq.ZMQError):
                    if self._sock.poll(LAST_WORDS_MS):
                        self._receive()
                self._router.fail_all("lost the connection to the engine")
                return
        why = self._death.unreachable()
        if why is not None:
            # What was sent waits in the socket's queue: dropped, so an engine that comes up later never runs
            # it.
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disconnect(self.endpoint)
            self._router.fail_all(why, ErrorCode.UNREACHABLE)

    async def _watch(self) -> None:
        """Twice a second: the owned engine process still alive (and, belt and braces, nothing left
        unread)."""
        while self._router.dead is None:
            await asyncio.sleep(0.5)
            self._on_readable()
            why = engine_exit_reason(self._engine)
            if why is not None:
                self._receive()
                self._router.fail_all(why)

    def _receive(self) -> None:
        for data in ready_frames(self._sock):
            try:
                msg = decode_msg(data)
            except msgspec.DecodeError as e:
                log.error("dropped an undecodable frame from the engine: %s", e)
                continue
            self._router.route(msg)

"""The asyncio client: the same API as Client, with `async`. One receiver task routes outputs."""
from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Sequence

import zmq
import zmq.asyncio
from tqdm import tqdm

from frontend.completion import Completion, CompletionDelta, to_delta
from frontend.connection import decode_msg, encode_msg, is_dead_event, open_dealer
from frontend.request_encoding import Params, Prompt, build_request, new_rid, params_per_prompt
from protocol.errors import EngineDeadError, TandemError, error_from_code
from protocol.messages import (
    AbortRequest,
    EngineStats,
    OutputBatch,
    RequestError,
    RequestOutput,
    StatsRequest,
)

_Item = RequestOutput | TandemError


class AsyncClient:
    def __init__(self, endpoint: str, *, engine: subprocess.Popen | None = None) -> None:
        self.endpoint = endpoint
        self._engine = engine
        self._ctx = zmq.asyncio.Context()
        self._sock, self._monitor = open_dealer(self._ctx, endpoint)
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._stats: dict[str, asyncio.Future[EngineStats]] = {}
        self._receiver: asyncio.Task | None = None
        self._dead: str | None = None

    @classmethod
    def launch(cls, model: str, **engine_options: object) -> AsyncClient:
        from launch.engine_process import start_engine_process  # the one lazy arrow back to launch/

        proc, endpoint = start_engine_process(model, **engine_options)
        return cls(endpoint, engine=proc)

    async def generate(self, prompt: Prompt, params: Params = None, request_id: str | None = None) -> Completion:
        rid = await self._submit(prompt, params, request_id)
        comp = Completion(rid)
        async for out in self._outputs(rid):
            comp.add(out)
        return comp

    async def stream(
        self, prompt: Prompt, params: Params = None, request_id: str | None = None
    ) -> AsyncIterator[CompletionDelta]:
        rid = await self._submit(prompt, params, request_id)
        async for out in self._outputs(rid):
            yield to_delta(out)

    async def generate_batch(
        self, prompts: Sequence[Prompt], params: Params | Sequence[Params] = None, progress: bool = True
    ) -> list[Completion]:
        plist = params_per_prompt(prompts, params)
        bar = tqdm(total=len(prompts), disable=not progress, desc="generate")

        async def one(p: Prompt, sp: Params) -> Completion:
            c = await self.generate(p, sp)
            bar.update(1)
            return c

        try:
            return list(await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, plist))))
        finally:
            bar.close()

    async def stats(self) -> EngineStats:
        self._check_alive()
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive())
        rid = new_rid()
        fut: asyncio.Future[EngineStats] = asyncio.get_running_loop().create_future()
        self._stats[rid] = fut
        await self._sock.send(encode_msg(StatsRequest(rid)))
        return await fut

    async def abort(self, request_id: str) -> None:
        self._check_alive()
        await self._sock.send(encode_msg(AbortRequest(request_id)))

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            self._receiver = None
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()
        if self._engine is not None:
            from launch.engine_process import stop_engine_process

            await asyncio.to_thread(stop_engine_process, self._engine)
            self._engine = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- internals -------------------------------------------------------------------------------
    async def _submit(self, prompt: Prompt, params: Params, rid: str | None) -> str:
        self._check_alive()
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive())
        req = build_request(prompt, params, rid)
        self._queues[req.rid] = asyncio.Queue()
        await self._sock.send(encode_msg(req))
        return req.rid

    async def _outputs(self, rid: str) -> AsyncIterator[RequestOutput]:
        q = self._queues[rid]
        try:
            while True:
                item = await q.get()
                if isinstance(item, TandemError):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(rid, None)

    def _check_alive(self) -> None:
        if self._dead is None and self._engine is not None and self._engine.poll() is not None:
            self._mark_dead(f"engine process exited with code {self._engine.returncode}")
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    async def _receive(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while self._dead is None:
            events = dict(await poller.poll(500))
            if self._monitor in events and is_dead_event(await self._monitor.recv_multipart()):
                self._mark_dead("lost the connection to the engine")
            self._check_alive_quiet()
            if self._sock not in events:
                continue
            msg = decode_msg(await self._sock.recv())
            if isinstance(msg, OutputBatch):
                for out in msg.outputs:
                    q = self._queues.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, EngineStats):
                fut = self._stats.pop(msg.rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, RequestError):
                q = self._queues.get(msg.rid)
                if q is not None:
                    q.put_nowait(error_from_code(msg.code, msg.message))

    def _check_alive_quiet(self) -> None:
        if self._dead is None and self._engine is not None and self._engine.poll() is not None:
            self._mark_dead(f"engine process exited with code {self._engine.returncode}")

    def _mark_dead(self, why: str) -> None:
        self._dead = why
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(why))
        for fut in self._stats.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))

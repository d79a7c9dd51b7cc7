"""The synchronous Python client: `Client(endpoint)` or `Client.launch(model_dir, **engine_options)`.

Single-threaded: each call pumps the socket until its own request is done, buffering the others'.
"""
from __future__ import annotations

import subprocess
import time
from collections import deque
from collections.abc import Iterator, Sequence

import zmq
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


class _Pending:
    __slots__ = ("outputs", "error", "done")

    def __init__(self) -> None:
        self.outputs: deque[RequestOutput] = deque()
        self.error: TandemError | None = None
        self.done = False


class Client:
    def __init__(self, endpoint: str, *, engine: subprocess.Popen | None = None) -> None:
        self.endpoint = endpoint
        self._engine = engine
        self._ctx = zmq.Context()
        self._sock, self._monitor = open_dealer(self._ctx, endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._pending: dict[str, _Pending] = {}
        self._stats: dict[str, EngineStats] = {}
        self._dead: str | None = None
        self._closed = False

    @classmethod
    def launch(cls, model: str, **engine_options: object) -> Client:
        """Start an engine this client owns; it stops on close() or at the end of a `with` block."""
        from launch.engine_process import start_engine_process  # the one lazy arrow back to launch/

        proc, endpoint = start_engine_process(model, **engine_options)
        return cls(endpoint, engine=proc)

    # ---- public API ------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: Params = None, request_id: str | None = None) -> Completion:
        rid = self._submit(prompt, params, request_id)
        comp = Completion(rid)
        for out in self._outputs(rid):
            comp.add(out)
        return comp

    def stream(self, prompt: Prompt, params: Params = None, request_id: str | None = None) -> Iterator[CompletionDelta]:
        rid = self._submit(prompt, params, request_id)
        for out in self._outputs(rid):
            yield to_delta(out)

    def generate_batch(
        self, prompts: Sequence[Prompt], params: Params | Sequence[Params] = None, progress: bool = True
    ) -> list[Completion]:
        plist = params_per_prompt(prompts, params)
        rids = [self._submit(p, sp) for p, sp in zip(prompts, plist)]
        comps = {rid: Completion(rid) for rid in rids}
        with tqdm(total=len(rids), disable=not progress, desc="generate") as bar:
            remaining = set(rids)
            while remaining:
                self._pump(None)
                for rid in list(remaining):
                    p = self._pending[rid]
                    while p.outputs:
                        comps[rid].add(p.outputs.popleft())
                    if p.error is not None:
                        raise p.error
                    if p.done:
                        remaining.discard(rid)
                        del self._pending[rid]
                        bar.update(1)
        return [comps[r] for r in rids]

    def stats(self, timeout_s: float = 30.0) -> EngineStats:
        """The engine's counters; the scheduler runs its integrity check to answer."""
        rid = self._submit_stats()
        deadline = time.monotonic() + timeout_s
        while rid not in self._stats:
            if time.monotonic() > deadline:
                raise TimeoutError("no stats reply")
            self._check_alive()
            self._pump(100)
        return self._stats.pop(rid)

    def abort(self, request_id: str) -> None:
        self._check_alive()
        self._sock.send(encode_msg(AbortRequest(request_id)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()
        if self._engine is not None:
            from launch.engine_process import stop_engine_process

            stop_engine_process(self._engine)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------
    def _submit(self, prompt: Prompt, params: Params, rid: str | None = None) -> str:
        self._check_alive()
        req = build_request(prompt, params, rid)
        self._pending[req.rid] = _Pending()
        self._sock.send(encode_msg(req))
        return req.rid

    def _submit_stats(self) -> str:
        self._check_alive()
        rid = new_rid()
        self._sock.send(encode_msg(StatsRequest(rid)))
        return rid

    def _outputs(self, rid: str) -> Iterator[RequestOutput]:
        p = self._pending[rid]
        try:
            while True:
                while p.outputs:
                    yield p.outputs.popleft()
                if p.error is not None:
                    raise p.error
                if p.done:
                    return
                self._pump(None)
        finally:
            self._pending.pop(rid, None)

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("client is closed")
        if self._dead is None and self._engine is not None and self._engine.poll() is not None:
            self._mark_dead(f"engine process exited with code {self._engine.returncode}")
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _pump(self, timeout_ms: int | None) -> None:
        """Receive what has arrived (waiting up to timeout) and route it to the pending requests."""
        wait = 500 if timeout_ms is None else timeout_ms
        events = dict(self._poller.poll(wait))
        if self._monitor in events and is_dead_event(self._monitor.recv_multipart()):
            self._mark_dead("lost the connection to the engine")
        self._check_alive_quiet()
        if self._sock not in events:
            return
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = decode_msg(data)
            if isinstance(msg, OutputBatch):
                for out in msg.outputs:
                    p = self._pending.get(out.rid)
                    if p is not None:
                        p.outputs.append(out)
                        p.done = p.done or out.finished
            elif isinstance(msg, EngineStats):
                self._stats[msg.rid] = msg
            elif isinstance(msg, RequestError):
                p = self._pending.get(msg.rid)
                if p is not None:
                    p.error = error_from_code(msg.code, msg.message)

    def _check_alive_quiet(self) -> None:
        if self._dead is None and self._engine is not None and self._engine.poll() is not None:
            self._mark_dead(f"engine process exited with code {self._engine.returncode}")

    def _mark_dead(self, why: str) -> None:
        self._dead = why
        for p in self._pending.values():
            if not p.done and p.error is None:
                p.error = EngineDeadError(why)

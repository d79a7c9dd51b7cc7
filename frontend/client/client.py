"""The synchronous Python client: `Client(endpoint)` or `Client.launch(model_dir, **engine_options)`.

Thread-safe: one background I/O thread owns the socket (see client_io.py); any number of threads may call
generate, stream, generate_batch, abort and stats on one Client. A call that stops listening (a stream
left early, an exception, an error in generate_batch) aborts its requests in the engine.
"""
from __future__ import annotations

import queue
import subprocess
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from frontend.client.client_io import ClientIO
from frontend.client.connection import encode_msg
from frontend.client.request_encoding import Params, Prompt, build_request, new_rid, params_per_prompt
from frontend.client.router import Item
from frontend.completion import Completion, CompletionDelta, to_delta
from protocol.errors import EngineDeadError, TandemError
from protocol.messages import AbortRequest, EngineStats, RequestOutput, StatsRequest


class Client:
    def __init__(self, endpoint: str, *, engine: subprocess.Popen | None = None) -> None:
        self.endpoint = endpoint
        self._engine = engine
        self._io = ClientIO(endpoint, engine)

    @classmethod
    def launch(cls, model: str, **engine_options: object) -> Client:
        """Start an engine this client owns; it stops on close(), at the end of a `with` block, or when
        this process dies."""
        from frontend.client.engine_process import start_engine_process  # the one lazy arrow back to launch/

        proc, endpoint = start_engine_process(model, **engine_options)
        return cls(endpoint, engine=proc)

    # ---- public API ------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: Params = None, request_id: str | None = None) -> Completion:
        rid, items = self._submit(prompt, params, request_id)
        comp = Completion(rid)
        for out in self._outputs(rid, items):
            comp.add(out)
        return comp

    def stream(self, prompt: Prompt, params: Params = None, request_id: str | None = None) -> Iterator[CompletionDelta]:
        rid, items = self._submit(prompt, params, request_id)
        for out in self._outputs(rid, items):
            yield to_delta(out)

    def generate_batch(
        self, prompts: Sequence[Prompt], params: Params | Sequence[Params] = None, progress: bool = True
    ) -> list[Completion]:
        """All at once; the first error raises, and aborts the rest of the batch."""
        plist = params_per_prompt(prompts, params)
        reqs = [build_request(p, sp) for p, sp in zip(prompts, plist)]
        self._check_alive()
        items: queue.SimpleQueue[tuple[str, Item]] = queue.SimpleQueue()  # one queue for the whole batch
        comps = {r.rid: Completion(r.rid) for r in reqs}
        remaining = set(comps)
        try:
            for r in reqs:
                self._io.open(r.rid, lambda item, rid=r.rid: items.put((rid, item)), encode_msg(r))
            with tqdm(total=len(reqs), disable=not progress, desc="generate") as bar:
                while remaining:
                    rid, item = items.get()
                    if isinstance(item, TandemError):
                        raise item
                    assert isinstance(item, RequestOutput)  # the router gives a request only outputs
                    comps[rid].add(item)
                    if item.finished:
                        remaining.discard(rid)
                        bar.update(1)
        finally:
            for rid in remaining:
                self._io.close_call(rid, encode_msg(AbortRequest(rid)))
        return [comps[r.rid] for r in reqs]

    def stats(self, timeout_s: float = 30.0) -> EngineStats:
        """The engine's counters; the scheduler runs its integrity check to answer."""
        self._check_alive()
        rid = new_rid()
        items: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._io.open(rid, items.put, encode_msg(StatsRequest(rid)), is_request=False)
        try:
            item = items.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError("no stats reply") from None
        finally:
            self._io.close_call(rid, b"")
        if isinstance(item, TandemError):
            raise item
        assert isinstance(item, EngineStats)
        return item

    def abort(self, request_id: str) -> None:
        """Stop a request this client submitted; its call ends with finish_reason "abort"."""
        self._check_alive()
        self._io.send(encode_msg(AbortRequest(request_id)))

    def close(self) -> None:
        self._io.stop()
        if self._engine is not None:
            from frontend.client.engine_process import stop_engine_process

            stop_engine_process(self._engine)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------------
    def _submit(self, prompt: Prompt, params: Params, rid: str | None) -> tuple[str, queue.SimpleQueue[Item]]:
        req = build_request(prompt, params, rid)
        self._check_alive()
        items: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._io.open(req.rid, items.put, encode_msg(req))
        return req.rid, items

    def _outputs(self, rid: str, items: queue.SimpleQueue[Item]) -> Iterator[RequestOutput]:
        done = False
        try:
            while not done:
                item = items.get()
                if isinstance(item, TandemError):
                    done = True
                    raise item
                assert isinstance(item, RequestOutput)
                done = item.finished
                yield item
        finally:
            if not done:  # left early (break, exception, garbage collection): nothing runs for nobody
                self._io.close_call(rid, encode_msg(AbortRequest(rid)))

    def _check_alive(self) -> None:
        why = self._io.dead
        if why is not None:
            raise EngineDeadError(why)

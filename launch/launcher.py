"""Starts every process (spawn), waits for each to report ready, and tears all down together.

If any child dies, everything stops: the frontend's socket closes and clients waiting on requests
get an error instead of hanging.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import shutil
import time
from multiprocessing.process import BaseProcess

import zmq

from protocol.codec import encode, launcher_decoder
from protocol.engine_config import EngineConfig
from protocol.ipc import Endpoints, make_socket
from protocol.messages import EngineStopping, Failed, Ready
from protocol.model_info import read_model_info
from protocol.serve_config import ServeConfig


class EngineStartError(RuntimeError):
    pass


class Launcher:
    def __init__(self, cfg: EngineConfig, http: ServeConfig | None = None) -> None:
        self.cfg = cfg
        self.http = http  # the HTTP server's options: node 0 runs it as one more of its processes
        self.endpoints = Endpoints.create()
        self.procs: list[BaseProcess] = []
        self.ready: dict[str, str] = {}  # role+rank of each process that reported ready -> what it reported
        self._ctx = zmq.Context()

    def start(self) -> str:
        """Start all processes (the HTTP server's URL is then `ready["http0"]`); returns the endpoint a client
        connects to."""
        from detokenizer.process import run_detokenizer
        from frontend.http.process import run_http
        from frontend.server.process import run_frontend
        from scheduler.process import run_scheduler
        from worker.process import run_worker

        try:
            # Checked here once, before any child starts: a bad --model is one clear line, and a GGUF's
            # metadata files are written to the cache before the processes that read them race for them.
            read_model_info(self.cfg.model, self.cfg.max_model_len)
        except (ValueError, KeyError, NotImplementedError) as e:  # ModelLoadError is a ValueError
            raise EngineStartError(f"cannot load model {self.cfg.model}: {e}") from None
        ready = make_socket(self._ctx, zmq.PULL, self.endpoints.launcher, bind=True)
        spawn = mp.get_context("spawn")
        c, e = self.cfg.encode(), self.endpoints.encode()
        per_node = self.cfg.tp_size // self.cfg.nnodes
        first = self.cfg.node_rank * per_node
        targets = [(f"tandem-worker{r}", run_worker, (c, e, r)) for r in range(first, first + per_node)]
        if self.cfg.node_rank == 0:  # the scheduler, frontend and detokenizer live on node 0 only
            targets += [
                ("tandem-scheduler", run_scheduler, (c, e)),
                ("tandem-detokenizer", run_detokenizer, (c, e)),
                ("tandem-frontend", run_frontend, (c, e)),
            ]
            if self.http is not None and self.http.http:
                targets.append(("tandem-http", run_http, (c, e, self.http.encode())))
        for name, fn, args in targets:
            p = spawn.Process(target=fn, args=args, name=name, daemon=False)
            p.start()
            self.procs.append(p)
        try:
            self._wait_ready(ready, len(targets))
        except BaseException:
            ready.close(0)  # before stop(): terminating the context waits for every open socket
            self.stop()
            raise
        ready.close(0)
        return self.endpoints.client

    def _wait_ready(self, ready: zmq.Socket, expected: int) -> None:
        decode = launcher_decoder()
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while len(self.ready) < expected:
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine not ready after {self.cfg.startup_timeout_s}s: ready {sorted(self.ready)}")
            dead = [p for p in self.procs if p.exitcode is not None]
            if ready.poll(200) == 0:
                if dead:
                    raise EngineStartError(f"{dead[0].name} exited with code {dead[0].exitcode} during startup")
                continue
            msg = decode(ready.recv())
            if isinstance(msg, Failed):
                raise EngineStartError(f"{msg.role} failed to start: {msg.message}")
            assert isinstance(msg, Ready)
            self.ready[f"{msg.role}{msg.rank}"] = msg.info

    def wait(self, poll_s: float | None = None) -> BaseProcess | None:
        """Block until a child exits (returns it) or poll_s passes (returns None)."""
        sentinels = {p.sentinel: p for p in self.procs}
        done = multiprocessing.connection.wait(list(sentinels), timeout=poll_s)
        return sentinels[done[0]] if done else None  # type: ignore[index]

    def stop(self, reason: str = "the engine was stopped", grace_s: float = 3.0) -> None:
        """Stop every process. The frontend goes first, after telling each waiting client why."""
        frontend = next((p for p in self.procs if p.name == "tandem-frontend" and p.exitcode is None), None)
        if frontend is not None and "frontend0" in self.ready:
            notify = make_socket(self._ctx, zmq.PUSH, self.endpoints.frontend_in, bind=False)
            notify.setsockopt(zmq.LINGER, int(grace_s * 1000))
            notify.send(encode(EngineStopping(reason)))
            notify.close()
            frontend.join(grace_s)
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        self._ctx.term()
        shutil.rmtree(self.endpoints.root, ignore_errors=True)

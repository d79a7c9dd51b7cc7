"""Starts every process (spawn), waits for each to report ready, and tears all down together.

If any child dies, everything stops: the frontend's socket closes and clients waiting on requests
get an error instead of hanging. The launcher leaves last: it reaps every process it started, the ones
orphaned under it (it is their subreaper) and multiprocessing's resource tracker, before it returns.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
import signal
import time
from multiprocessing.process import BaseProcess

import msgspec
import zmq

from tandem.launch.failure_report import first_death
from tandem.launch.reaper import become_subreaper, reap_descendants, stop_resource_tracker
from tandem.protocol.codec import encode, launcher_decoder
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode
from tandem.protocol.ipc import Endpoints, make_socket, ready_frames
from tandem.protocol.messages import EngineStopping, Failed, LauncherMsg, Ready
from tandem.protocol.mmproj import projector_model_dir
from tandem.protocol.model_fit import ConfigError, check_model_fits
from tandem.protocol.serve_config import ServeConfig
from tandem.protocol.stop_messages import Drain


class EngineStartError(RuntimeError):
    pass


class Launcher:
    def __init__(self, cfg: EngineConfig, http: ServeConfig | None = None) -> None:
        if cfg.mmproj is not None:  # the text file and its projector, one model directory from here on
            cfg = dataclasses.replace(cfg, model=str(projector_model_dir(cfg.model, cfg.mmproj)), mmproj=None)
        self.cfg = cfg
        self.http = http  # the HTTP server's options: node 0 runs it as one more of its processes
        self.endpoints = Endpoints.create()
        self.procs: list[BaseProcess] = []
        self.ready: dict[str, str] = {}  # role+rank of each process that reported ready -> what it reported
        self.ready_after_s: dict[str, float] = {}  # role+rank -> seconds from start() to its report
        self._ctx = zmq.Context()
        self._control: zmq.Socket | None = None  # the children's messages: readiness, then stalls and drains
        self._decode = launcher_decoder()
        self._stopped = False
        self._t0 = time.monotonic()

    def start(self) -> str:
        """Start all processes (the HTTP server's URL is then `ready["http0"]`); returns the endpoint a client
        connects to."""
        from tandem.detokenizer.process import run_detokenizer
        from tandem.frontend.http.process import run_http
        from tandem.frontend.server.process import run_frontend
        from tandem.scheduler.process import run_scheduler
        from tandem.worker.process import run_worker

        try:
            # Checked here once, before any child starts: a bad --model or a configuration the model cannot
            # run is one clear line, and a GGUF's metadata files are written to the cache before the
            # processes that read them race for them.
            self._t0 = time.monotonic()
            check_model_fits(self.cfg)
        except ConfigError as e:
            raise EngineStartError(str(e)) from None
        except (ValueError, KeyError, NotImplementedError) as e:  # ModelLoadError is a ValueError
            raise EngineStartError(f"cannot load model {self.cfg.model}: {e}") from None
        become_subreaper()  # a worker's own children, orphaned by its death, come back here to be reaped
        self._control = make_socket(self._ctx, zmq.PULL, self.endpoints.launcher, bind=True)
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
            self._wait_ready(len(targets))
        except BaseException:
            self.stop()
            raise
        return self.endpoints.client

    def _wait_ready(self, expected: int) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while len(self.ready) < expected:
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine not ready after {self.cfg.startup_timeout_s}s: ready {sorted(self.ready)}"
                )
            dead, msgs = self.poll(0.2)
            for msg in msgs:
                if isinstance(msg, Failed):
                    raise EngineStartError(f"{msg.role} failed to start: {msg.message}")
                if isinstance(msg, Ready):
                    self.ready[f"{msg.role}{msg.rank}"] = msg.info
                    self.ready_after_s[f"{msg.role}{msg.rank}"] = time.monotonic() - self._t0
            if dead is not None and len(self.ready) < expected:
                raise EngineStartError(f"{dead.name} exited with code {dead.exitcode} during startup")

    def poll(self, timeout_s: float) -> tuple[BaseProcess | None, list[LauncherMsg]]:
        """Wait up to timeout_s for a child to exit or to send something: (a dead child or None, the
        messages)."""
        assert self._control is not None
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        for p in self.procs:
            poller.register(p.sentinel, zmq.POLLIN)  # readable once the process has exited
        poller.poll(int(timeout_s * 1000))
        msgs: list[LauncherMsg] = []
        for data in ready_frames(self._control):
            try:
                msgs.append(self._decode(data))
            except msgspec.DecodeError:  # only our children write here; a bad frame is dropped, not fatal
                continue
        return first_death(self.procs), msgs

    def drain(self, reason: str) -> None:
        """The frontend refuses new requests from now on and says `Drained` once none is left."""
        self._to_frontend(Drain(reason), linger_s=1.0)

    def stop(self, reason: str = "the engine was stopped", grace_s: float = 3.0,
             code: str = ErrorCode.ENGINE_DEAD) -> None:
        """Stop every process. The frontend goes first, after telling each waiting client why (with
        `code`)."""
        if self._stopped:
            return
        self._stopped = True
        frontend = next((p for p in self.procs if p.name == "tandem-frontend" and p.exitcode is None), None)
        if frontend is not None and self._to_frontend(EngineStopping(reason, code), linger_s=grace_s):
            frontend.join(grace_s)
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
                _resume(p)  # a stopped process (SIGSTOP) acts on the SIGTERM only once it runs again
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        reap_descendants(grace_s)
        stop_resource_tracker()
        if self._control is not None:
            self._control.close(0)
        self._ctx.term()
        shutil.rmtree(self.endpoints.root, ignore_errors=True)

    def _to_frontend(self, msg: Drain | EngineStopping, linger_s: float) -> bool:
        """Send to the frontend's inbox, once it is up; False when it is not (yet)."""
        if "frontend0" not in self.ready:
            return False
        notify = make_socket(self._ctx, zmq.PUSH, self.endpoints.frontend_in, bind=False)
        notify.setsockopt(zmq.LINGER, int(linger_s * 1000))
        notify.send(encode(msg))
        notify.close()
        return True


def _resume(p: BaseProcess) -> None:
    try:
        if p.pid is not None:
            os.kill(p.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass

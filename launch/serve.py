"""`tandem serve`: run the engine until a signal or the death of any process."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing.process import BaseProcess

from launch.launcher import EngineStartError, Launcher
from protocol.codec import launcher_decoder
from protocol.engine_config import EngineConfig
from protocol.messages import Failed
from protocol.serve_config import ServeConfig

READY_PREFIX = "tandem: ready at "
HTTP_PREFIX = "tandem: "
PROCESS_PREFIX = "tandem: process "


def start_http(launcher: Launcher, endpoint: str, scfg: ServeConfig) -> str:
    """Start the HTTP process as one more of the engine's processes (it stops and dies with them);
    returns its URL once it listens."""
    from frontend.http.process import run_http

    parent, child = mp.Pipe(duplex=False)
    p: BaseProcess = mp.get_context("spawn").Process(
        target=run_http, name="tandem-http", daemon=False,
        args=(endpoint, launcher.cfg.model, launcher.cfg.max_model_len, scfg.encode(), child),
    )
    p.start()
    launcher.procs.append(p)
    child.close()
    while not parent.poll(0.2):
        if p.exitcode is not None:
            raise EngineStartError(f"tandem-http exited with code {p.exitcode} during startup")
    msg = launcher_decoder()(parent.recv_bytes())
    if isinstance(msg, Failed):
        raise EngineStartError(f"the HTTP server failed to start: {msg.message}")
    return msg.info


def serve(cfg: EngineConfig, scfg: ServeConfig | None = None, owner_fd: int | None = None) -> int:
    scfg = scfg or ServeConfig()
    launcher = Launcher(cfg)
    stopping = {"reason": "the engine was stopped"}

    def on_signal(signum: int, _frame: object) -> None:
        if stopping.get("signalled"):  # already stopping: a second signal must not cut the teardown short
            return
        stopping["signalled"] = "yes"
        if signum != signal.SIGUSR1:
            stopping["reason"] = f"the engine was stopped ({signal.Signals(signum).name})"
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGUSR1, on_signal)
    if owner_fd is not None:
        _stop_when_closed(owner_fd, stopping)
    try:
        endpoint = launcher.start()
        url = start_http(launcher, endpoint, scfg) if scfg.http and cfg.node_rank == 0 else None
    except EngineStartError as e:
        print(f"tandem: engine failed to start: {e}", file=sys.stderr, flush=True)
        launcher.stop()
        return 1
    except KeyboardInterrupt:
        launcher.stop(stopping["reason"])
        return 0
    for p in launcher.procs:
        print(f"{PROCESS_PREFIX}{p.name} {p.pid}", flush=True)
    if cfg.node_rank == 0:
        print(f"{READY_PREFIX}{endpoint}", flush=True)
        if url is not None:
            print(f"{HTTP_PREFIX}{url}", flush=True)
    else:
        print(f"tandem: node {cfg.node_rank} workers ready (clients connect to node 0)", flush=True)
    try:
        dead = None
        while dead is None:
            dead = launcher.wait(1.0)
        why = f"{dead.name} exited with code {dead.exitcode}"
        print(f"tandem: {why}; stopping the engine", file=sys.stderr, flush=True)
        launcher.stop(f"the engine stopped: {why}")
        return 1
    except KeyboardInterrupt:
        launcher.stop(stopping["reason"])
        return 0


def _stop_when_closed(fd: int, stopping: dict[str, str]) -> None:
    """The owner holds the other end of this pipe: end of file means it died (or let go), so stop."""

    def watch() -> None:
        while os.read(fd, 4096):
            pass
        stopping["reason"] = "the engine's owner process died"
        os.kill(os.getpid(), signal.SIGUSR1)  # the main thread stops the engine, as on SIGTERM
        with contextlib.suppress(OSError):  # stderr was most likely a pipe to the dead owner
            print("tandem: the owner of this engine is gone; stopping", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()

"""`tandem serve`: run the engine until a signal or the death of any process.

What it prints is for people (and tests that read it as people do); a program that starts it passes
`--owner-fd` and reads the one `Ready` record written there.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

from launch.launcher import EngineStartError, Launcher
from protocol.codec import encode
from protocol.engine_config import EngineConfig
from protocol.messages import Ready
from protocol.serve_config import ServeConfig

READY_PREFIX = "tandem: ready at "
HTTP_PREFIX = "tandem: "
PROCESS_PREFIX = "tandem: process "


def serve(cfg: EngineConfig, scfg: ServeConfig | None = None, owner_fd: int | None = None) -> int:
    scfg = scfg or ServeConfig()
    launcher = Launcher(cfg, scfg)
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
    try:
        owner = None if owner_fd is None else socket.socket(fileno=owner_fd)
    except OSError as e:  # not an inherited socket
        print(f"tandem serve: --owner-fd {owner_fd}: {e}", file=sys.stderr, flush=True)
        return 2
    if owner is not None:
        _stop_when_closed(owner, stopping)
    try:
        endpoint = launcher.start()
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
        if "http0" in launcher.ready:
            print(f"{HTTP_PREFIX}{launcher.ready['http0']}", flush=True)
        if owner is not None:
            with contextlib.suppress(OSError):  # a dead owner: the watch stops the engine
                owner.sendall(encode(Ready("engine", 0, endpoint)))
                owner.shutdown(socket.SHUT_WR)  # the record is whole; the owner still holds its end
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


def _stop_when_closed(owner: socket.socket, stopping: dict[str, str]) -> None:
    """The owner holds the other end of this socket: end of file means it died (or let go), so stop."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while owner.recv(4096):
                pass
        stopping["reason"] = "the engine's owner process died"
        os.kill(os.getpid(), signal.SIGUSR1)  # the main thread stops the engine, as on SIGTERM
        with contextlib.suppress(OSError):  # stderr was most likely a pipe to the dead owner
            print("tandem: the owner of this engine is gone; stopping", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()

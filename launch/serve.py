"""`tandem serve`: run the engine until a signal, a drain, a stall or the death of any process.

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

from tandem.launch.failure_report import describe_death, describe_failure
from tandem.launch.launcher import EngineStartError, Launcher
from tandem.launch.stall_report import describe_stall
from tandem.launch.stop_plan import StopPlan
from tandem.protocol.codec import encode
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode
from tandem.protocol.messages import Ready
from tandem.protocol.serve_announcements import HTTP_PREFIX, PROCESS_PREFIX, READY_PREFIX
from tandem.protocol.serve_config import ServeConfig
from tandem.protocol.stop_messages import Drained, DrainRequest, Stalled, WorkerFailed


class _Signals:
    """SIGTERM and SIGINT drain, SIGUSR1 (the owner died) stops. While the engine starts, any of them stops
    the start at once (KeyboardInterrupt); afterwards they queue for the serve loop, which acts on them
    between polls (nothing is ever interrupted half way)."""

    def __init__(self) -> None:
        self.starting = True
        self.pending: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.pending.append(signum)
        if self.starting and len(self.pending) == 1:
            raise KeyboardInterrupt

    def take(self) -> list[int]:
        out, self.pending = self.pending, []
        return out


def _reason(signum: int) -> str:
    if signum == signal.SIGUSR1:
        return "the engine's owner process died"
    return f"the engine was stopped ({signal.Signals(signum).name})"


def serve(cfg: EngineConfig, scfg: ServeConfig | None = None, owner_fd: int | None = None) -> int:
    scfg = scfg or ServeConfig()
    launcher = Launcher(cfg, scfg)
    signals = _Signals()
    try:
        owner = None if owner_fd is None else socket.socket(fileno=owner_fd)
    except OSError as e:  # not an inherited socket
        print(f"tandem serve: --owner-fd {owner_fd}: {e}", file=sys.stderr, flush=True)
        return 2
    if owner is not None:
        _stop_when_closed(owner)
    try:
        endpoint = launcher.start()
    except EngineStartError as e:
        _say(f"tandem: engine failed to start: {e}")
        launcher.stop()
        return 1
    except KeyboardInterrupt:
        launcher.stop(_reason(signals.pending[0]))
        return 0
    signals.starting = False
    took = sorted(launcher.ready_after_s.items(), key=lambda kv: -kv[1])
    _say(f"tandem: ready in {took[0][1]:.2f} s ({', '.join(f'{k} {v:.2f}' for k, v in took)})")
    try:
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
        return _supervise(launcher, cfg, signals)
    finally:  # whatever ends the supervision (a reader of stdout gone, too), the children go first: the
        # interpreter's exit would wait on them forever
        launcher.stop("the engine's supervisor stopped")


def _say(text: str) -> None:
    """A line for people on stderr; one nobody reads any more (a closed pipe) is dropped, not raised: the
    supervisor must go on to stop the engine."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


def _supervise(launcher: Launcher, cfg: EngineConfig, signals: _Signals) -> int:
    """Serve until a stop is due (StopPlan); returns the exit code."""
    # A drain needs the frontend, which lives on node 0: another node's workers stop at once.
    plan = StopPlan(cfg.drain_timeout_s if cfg.node_rank == 0 else 0.0)
    while True:
        for signum in signals.take():
            if signum == signal.SIGUSR1:
                plan.stop_now(_reason(signum))
            elif plan.on_signal(_reason(signum)):
                _start_drain(launcher, plan)
        stop = plan.due()
        if stop is not None:
            launcher.stop(stop.reason, code=stop.code)
            return stop.exit_code
        dead, msgs = launcher.poll(0.2)
        for msg in msgs:
            if isinstance(msg, Stalled):
                why = describe_stall(msg, launcher.procs, cfg.step_timeout_s)
                _say(f"tandem: {why}; stopping the engine")
                plan.stop_now(why, ErrorCode.STALLED, exit_code=1)
            elif isinstance(msg, DrainRequest) and plan.request_drain(msg.reason):
                _start_drain(launcher, plan)
            elif isinstance(msg, Drained):
                plan.drained()
            elif isinstance(msg, WorkerFailed) and plan.stop is None:
                why = describe_failure(msg, launcher.procs)
                _say(f"tandem: {why}; stopping the engine")
                plan.stop_now(f"the engine stopped: {why}", exit_code=1)
        if dead is not None and plan.stop is None:
            why = describe_death(dead)
            _say(f"tandem: {why}; stopping the engine")
            plan.stop_now(f"the engine stopped: {why}", exit_code=1)


def _start_drain(launcher: Launcher, plan: StopPlan) -> None:
    assert plan.draining is not None
    _say(f"tandem: draining ({plan.draining}): running requests get up to {plan.drain_timeout_s:g} s, "
         "new ones are refused")
    launcher.drain(plan.draining)


def _stop_when_closed(owner: socket.socket) -> None:
    """The owner holds the other end of this socket: end of file means it died (or let go), so stop."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while owner.recv(4096):
                pass
        os.kill(os.getpid(), signal.SIGUSR1)  # the main thread stops the engine
        with contextlib.suppress(OSError):  # stderr was most likely a pipe to the dead owner
            print("tandem: the owner of this engine is gone; stopping", file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()

"""Why the engine stops after a process died or a worker failed: the reason every waiting call gets.

A worker's failure may only echo another process's death: a tensor-parallel rank is killed, and its peer's
next collective reads a closed socket. The launcher holds every process, so before it believes a report it
looks for a death beside it; the reporting rank itself waits to be stopped, so any death it finds is
another's.
"""
from __future__ import annotations

import signal
import time
from multiprocessing.process import BaseProcess

from tandem.launch.stall_report import WORKER
from tandem.protocol.stop_messages import WorkerFailed

# A killed peer's sockets close as it exits, a moment before its exit is reaped: long enough for that.
ECHO_WAIT_S = 1.0


def describe_death(p: BaseProcess) -> str:
    code = p.exitcode or 0
    how = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
    return f"{p.name} (pid {p.pid}) exited with code {code}{how}"


def first_death(procs: list[BaseProcess], skip: str = "") -> BaseProcess | None:
    """The dead process most likely to be the cause: one killed by a signal before one that exited."""
    dead = [p for p in procs if p.exitcode is not None and p.name != skip]
    return min(dead, key=lambda p: (p.exitcode or 0) >= 0, default=None)


def describe_failure(msg: WorkerFailed, procs: list[BaseProcess], wait_s: float = ECHO_WAIT_S) -> str:
    """Another process's death if one shows within wait_s, else the rank's own report."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = first_death(procs, skip=f"{WORKER}{msg.rank}")
        if dead is not None:
            return describe_death(dead)
        if time.monotonic() >= deadline:
            return f"worker {msg.rank} failed: {msg.message}"
        time.sleep(0.02)

"""A stalled step named: which worker rank holds it up, and how (stopped, dead, busy or waiting).

The scheduler only knows that a step did not come back; the launcher holds every rank's process, so the
reason the waiting calls get is written here.
"""
from __future__ import annotations

import time
from multiprocessing.process import BaseProcess

import psutil

from tandem.protocol.stop_messages import Stalled

WORKER = "tandem-worker"
BUSY_SAMPLE_S = 0.3  # CPU time is sampled over this long to tell a spinning rank from a waiting one
BUSY_SHARE = 0.5


def rank_state(p: BaseProcess) -> tuple[int, str]:
    """(how suspicious, 0 = most; what the rank is doing)."""
    if p.exitcode is not None:
        return 0, f"exited with code {p.exitcode}"
    try:
        proc = psutil.Process(p.pid)
        status = proc.status()
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return 0, "is stopped (SIGSTOP or a debugger)"
        if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return 0, "has exited"
        t0 = sum(proc.cpu_times()[:2])
        time.sleep(BUSY_SAMPLE_S)
        busy = (sum(proc.cpu_times()[:2]) - t0) / BUSY_SAMPLE_S
    except psutil.NoSuchProcess:
        return 0, "has exited"
    if busy > BUSY_SHARE:
        return 1, f"is busy on the CPU ({busy:.0%}: a kernel spinning?)"
    return 2, "is waiting (on a collective with a dead or stalled peer, or on the device?)"


def describe_stall(msg: Stalled, procs: list[BaseProcess], timeout_s: float | None) -> str:
    """The reason waiting calls get: the stall, then the rank(s) most likely to blame."""
    flag = f"--step-timeout-s {timeout_s:g}" if timeout_s is not None else "the default step timeout"
    head = (
        f"the engine stalled: step {msg.step_id} did not come back from the workers in {msg.waited_s:.1f} s "
        f"(limit {msg.limit_s:g} s, {flag})"
    )
    ranks = [(int(p.name[len(WORKER):]), p) for p in procs if p.name.startswith(WORKER)]
    if not ranks:
        return f"{head}; no worker rank runs on this node"
    states = sorted((*rank_state(p), r, p.pid) for r, p in ranks)
    worst = states[0][0]
    named = [f"worker rank {r} (pid {pid}) {what}" for level, what, r, pid in states if level == worst]
    return f"{head}: {'; '.join(named)}"

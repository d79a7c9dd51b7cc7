"""The launcher leaves last: no process it started, directly or not, outlives it.

A supervisor that restarts `tandem serve` must never race a child still holding the port or the socket
directory. Three kinds of process could outlive the launcher: the ones it started (joined by the launcher),
their own children orphaned when a parent dies (SIGKILL skips every cleanup): on Linux the launcher is
their subreaper, so they come back to it here; and multiprocessing's resource tracker, which otherwise
exits on its own only after the launcher, once it sees the end of its pipe.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys

import psutil

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans among this process's descendants are re-parented to it, not to init (Linux; else a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def reap_descendants(grace_s: float) -> None:
    """Terminate, then kill, every descendant still alive (the resource tracker aside), and reap each child
    (zombies included) so nothing is left in the process table."""
    me = psutil.Process()
    tracker = _tracker_pid()
    with contextlib.suppress(psutil.Error):
        procs = [p for p in me.children(recursive=True) if p.pid != tracker]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
                p.resume()
        _, alive = psutil.wait_procs(procs, timeout=grace_s)  # reaps those that are our children
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=grace_s)


def stop_resource_tracker() -> None:
    """End multiprocessing's resource tracker now and reap it. It exits when every holder of its pipe has
    closed it: the children are gone, so closing ours is the last."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    stop = getattr(tracker, "_stop", None)  # CPython's own shutdown of the tracker (3.8+), private
    if stop is None or getattr(tracker, "_pid", None) is None:
        return
    with contextlib.suppress(OSError, ChildProcessError):
        stop()
    pid = getattr(tracker, "_pid", None)
    if pid is not None:  # _stop did not run (a reentrant call): do its part
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
            os.waitpid(pid, 0)

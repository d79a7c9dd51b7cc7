"""Endpoints and socket helpers shared by every process.

Endpoints are ipc:// paths in a private (0700) temp dir made per launch: never a fixed port or name.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import zmq


@dataclass(frozen=True)
class Endpoints:
    root: str

    @classmethod
    def create(cls) -> Endpoints:
        # mkdtemp makes the dir 0700: only this user can connect to the sockets inside.
        return cls(tempfile.mkdtemp(prefix="tandem-"))

    def _ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.root, name)}"

    @property
    def client(self) -> str:
        return self._ipc("client")

    @property
    def scheduler_in(self) -> str:
        return self._ipc("scheduler_in")

    @property
    def scheduler_results(self) -> str:
        return self._ipc("scheduler_results")

    def worker_in(self, rank: int) -> str:
        return self._ipc(f"worker_{rank}_in")

    @property
    def detok_in(self) -> str:
        return self._ipc("detok_in")

    @property
    def frontend_in(self) -> str:
        return self._ipc("frontend_in")

    @property
    def launcher(self) -> str:
        return self._ipc("launcher")

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Endpoints:
        return msgspec.json.decode(data, type=cls)


def ready_frames(sock: zmq.Socket) -> Iterator[bytes]:
    """Every message the socket holds now, without waiting (what a loop reads once a poll says it is
    readable); the caller may stop early, leaving the rest queued."""
    while True:
        try:
            yield sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def ready_multipart(sock: zmq.Socket) -> Iterator[list[bytes]]:
    """As ready_frames, for multipart messages (a ROUTER's: the sender's identity first)."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    # Unbounded queues: a PUSH never drops and a slow peer only delays; linger 0 so exit never hangs.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def exit_with_parent(poll_s: float = 0.5) -> None:
    """This process exits when its parent dies, however it dies: at once by PR_SET_PDEATHSIG (Linux), and
    by a watch on the parent's pid as the portable backstop."""
    parent_proc = multiprocessing.parent_process()  # the real parent, even if it died before this line
    parent = parent_proc.pid if parent_proc is not None and parent_proc.pid else os.getppid()
    set_parent_death_signal(signal.SIGTERM)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(poll_s)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def set_parent_death_signal(sig: int) -> None:
    """Have the kernel send `sig` when the thread that started this process ends (Linux; elsewhere a
    no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


_PR_SET_PDEATHSIG = 1

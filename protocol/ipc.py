"""Endpoints and socket helpers shared by every process.

Endpoints are ipc:// paths in a private (0700) temp dir made per launch: never a fixed port or name.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
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
    """Every process exits when its parent dies (the launcher tears the rest down)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

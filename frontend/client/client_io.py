"""The sync client's I/O thread: the only thread that touches its socket.

Callers on any thread post commands (open a call, close one, send a message) to a queue and wake the
thread through a pipe; the thread sends them, routes what arrives through the Router into each call's
queue, and notices the engine's death. So one `Client` may be shared by any number of threads.
"""
from __future__ import annotations

import logging
import os
import queue
import subprocess
import threading
from dataclasses import dataclass

import msgspec
import zmq

from frontend.client.connection import decode_msg, engine_exit_reason, is_dead_event, open_dealer
from frontend.client.router import Router, Sink
from protocol.errors import EngineDeadError

log = logging.getLogger("tandem.client")

CLOSED = "client is closed"


@dataclass(frozen=True)
class _Open:
    rid: str
    sink: Sink
    frame: bytes
    is_request: bool


@dataclass(frozen=True)
class _Close:
    rid: str
    abort_frame: bytes  # sent when the request had not ended


@dataclass(frozen=True)
class _Send:
    frame: bytes


_Command = _Open | _Close | _Send


class ClientIO:
    def __init__(self, endpoint: str, engine: subprocess.Popen | None) -> None:
        self._engine = engine
        self._ctx = zmq.Context()
        self._sock, self._monitor = open_dealer(self._ctx, endpoint)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()  # orders "post a command" against "stop": no command is stranded
        self._stopping = False
        self.router = Router()  # touched by the I/O thread only
        self._thread = threading.Thread(target=self._run, name="tandem-client-io", daemon=True)
        self._thread.start()

    @property
    def dead(self) -> str | None:
        return CLOSED if self._stopping else self.router.dead

    def open(self, rid: str, sink: Sink, frame: bytes, is_request: bool = True) -> None:
        self._post(_Open(rid, sink, frame, is_request))

    def close_call(self, rid: str, abort_frame: bytes) -> None:
        self._post(_Close(rid, abort_frame))

    def send(self, frame: bytes) -> None:
        self._post(_Send(frame))

    def stop(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- caller side -----------------------------------------------------------------------------
    def _post(self, cmd: _Command) -> None:
        with self._lock:
            if not self._stopping:
                self._commands.put(cmd)
                self._wake()
                return
        if isinstance(cmd, _Open):
            cmd.sink(EngineDeadError(CLOSED))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
            pass

    # ---- the I/O thread --------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(500))
                if self._wake_r in events:
                    os.read(self._wake_r, 65536)
                self._run_commands()
                if self._sock in events:
                    self._receive()
                # After draining the socket, so a typed reason the frontend sent on its way down wins.
                if self._monitor in events and is_dead_event(self._monitor.recv_multipart()):
                    self.router.fail_all("lost the connection to the engine")
                why = engine_exit_reason(self._engine)
                if why is not None:
                    self._receive()
                    self.router.fail_all(why)
        except Exception as e:  # a bug or a broken socket here: every waiting call must still hear of it
            log.exception("the client's I/O thread failed")
            self.router.fail_all(f"the client's I/O thread failed: {type(e).__name__}: {e}")
        finally:
            self._run_commands()
            self.router.fail_all(CLOSED)
            self._monitor.close(0)
            self._sock.close(0)
            self._ctx.term()

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Open):
                if self.router.open(cmd.rid, cmd.sink, cmd.is_request):
                    self._sock.send(cmd.frame)
            elif isinstance(cmd, _Close):
                if self.router.close(cmd.rid):
                    self._sock.send(cmd.abort_frame)
            elif self.router.dead is None:
                self._sock.send(cmd.frame)

    def _receive(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_msg(data)
            except msgspec.DecodeError as e:  # not from a tandem frontend of this version
                log.error("dropped an undecodable frame from the engine: %s", e)
                continue
            self.router.route(msg)

"""The client's socket to the frontend, with engine-death detection.

A DEALER socket plus a monitor: when the frontend's end goes away (the launcher tears every process
down when any dies), every waiting request gets EngineDeadError instead of hanging.
"""
from __future__ import annotations

import subprocess

import zmq
import zmq.utils.monitor

from tandem.protocol.codec import encode, frontend_decoder
from tandem.protocol.messages import ClientMsg, FrontendMsg

_DEAD_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_MONITOR_STOPPED
# The client's I/O loop reads whatever arrives; this only bounds what a stalled client process buffers
# before the frontend sees a full pipe (and aborts that client's requests).
RCV_HWM = 10_000


def open_dealer(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # requests are small and the frontend always reads
    sock.setsockopt(zmq.RCVHWM, RCV_HWM)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | _DEAD_EVENTS)
    sock.connect(endpoint)
    return sock, monitor


def release(ctx: zmq.Context, sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close the sockets (what is unsent is dropped), then their context. A client runs this itself, never
    the garbage collector: a context collected in one cycle with its sockets deadlocks, as the collector
    clears the context's weak set of sockets before its destroy() runs, which then waits for sockets it
    no longer sees."""
    monitor.close(0)
    sock.close(0)
    ctx.term()


class DeathWatch:
    """Reads the dealer's monitor events: the frontend's end is gone once a connection that was made is
    lost (DISCONNECTED or CLOSED after a CONNECTED) or the monitor stops. A CLOSED before any CONNECTED is
    a connect attempt that found nobody listening yet, which ZMQ retries: a client may start before the
    frontend binds (the HTTP process does, started beside the engine's processes)."""

    def __init__(self) -> None:
        self.connected = False

    def is_dead(self, monitor_frames: list[bytes]) -> bool:
        event = zmq.utils.monitor.parse_monitor_message(monitor_frames)["event"]
        if event & zmq.EVENT_CONNECTED:
            self.connected = True
            return False
        if event & zmq.EVENT_MONITOR_STOPPED:
            return True
        return self.connected and bool(event & _DEAD_EVENTS)


def engine_exit_reason(engine: subprocess.Popen | None) -> str | None:
    """Why the engine this client owns is gone, or None while it runs (or when the client owns none)."""
    if engine is None or engine.poll() is None:
        return None
    return f"engine process exited with code {engine.returncode}"


_decode = frontend_decoder()


def encode_msg(msg: ClientMsg) -> bytes:
    return encode(msg)


def decode_msg(data: bytes) -> FrontendMsg:
    return _decode(data)

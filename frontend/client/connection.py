"""The client's socket to the frontend, with engine-death detection.

A DEALER socket plus a monitor: when the frontend's end goes away (the launcher tears every process
down when any dies), every waiting request gets EngineDeadError instead of hanging; and a client that no
engine answers within its connect timeout (none was ever there, it exited, it never came up) is dead too,
its calls failed with `engine_dead.unreachable` naming the endpoint.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.utils.monitor

from tandem.protocol.codec import encode, frontend_decoder
from tandem.protocol.errors import InvalidRequestError
from tandem.protocol.messages import ClientMsg, FrontendMsg

_DEAD_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_MONITOR_STOPPED
# A ZMTP peer greeted us: something speaking our protocol is there (a bare TCP listener is not enough).
_ANSWERED = zmq.EVENT_HANDSHAKE_SUCCEEDED
CONNECT_TIMEOUT_S = 5.0  # how long a client waits for an engine to answer at its endpoint
# Over TCP a vanished host sends no FIN: ZMTP heartbeats find it (ipc's peer is on this host: its death
# closes).
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 2_000, 10_000
# The client's I/O loop reads whatever arrives; this only bounds what a stalled client process buffers
# before the frontend sees a full pipe (and aborts that client's requests).
RCV_HWM = 10_000


def open_dealer(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # requests are small and the frontend always reads
    sock.setsockopt(zmq.RCVHWM, RCV_HWM)
    if endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    monitor = sock.get_monitor_socket(_ANSWERED | _DEAD_EVENTS)
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
    """Reads the dealer's monitor events (socket-free: the client feeds it). The frontend's end is gone once
    a connection that answered is lost (DISCONNECTED or CLOSED after a handshake) or the monitor stops. A
    CLOSED before any handshake is a connect attempt that found nobody listening yet, which ZMQ retries: a
    client may start before the frontend binds (the HTTP process does, started beside the engine's
    processes). Retrying is bounded: with no handshake within connect_timeout_s of the client's start,
    `unreachable` says why (None: no bound)."""

    def __init__(self, endpoint: str, connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if connect_timeout_s is not None and not connect_timeout_s > 0:
            raise ValueError(
                f"connect_timeout_s must be > 0 (or None for no bound), got {connect_timeout_s!r}"
            )
        self.endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self.clock = clock
        self.deadline = None if connect_timeout_s is None else clock() + connect_timeout_s
        self.connected = False

    def is_dead(self, monitor_frames: list[bytes]) -> bool:
        event = zmq.utils.monitor.parse_monitor_message(monitor_frames)["event"]
        if event & _ANSWERED:
            self.connected = True
            return False
        if event & zmq.EVENT_MONITOR_STOPPED:
            return True
        return self.connected and bool(event & _DEAD_EVENTS)

    def unreachable(self) -> str | None:
        """Why the client gives up on an engine that never answered, once its deadline passed; else None."""
        if self.connected or self.deadline is None or self.clock() < self.deadline:
            return None
        return f"no engine answers at {self.endpoint} (waited {self.connect_timeout_s:g} s to connect)"


def engine_exit_reason(engine: subprocess.Popen | None) -> str | None:
    """Why the engine this client owns is gone, or None while it runs (or when the client owns none)."""
    if engine is None or engine.poll() is None:
        return None
    return f"engine process exited with code {engine.returncode}"


_decode = frontend_decoder()


def encode_msg(msg: ClientMsg) -> bytes:
    """A message the wire cannot carry (an integer past 64 bits, an object msgpack does not know) is the
    caller's error, typed, raised before anything is sent."""
    try:
        return encode(msg)
    except (OverflowError, TypeError, msgspec.EncodeError) as e:
        raise InvalidRequestError(f"the request cannot be encoded: {e}") from None


def decode_msg(data: bytes) -> FrontendMsg:
    return _decode(data)

"""The messages of an engine's stop. A drain has three: asked for (`DrainRequest`: a client -> the frontend,
which passes it on to the launcher), run (`Drain`: launcher -> frontend) and done (`Drained`: frontend ->
launcher). Then a stalled step (scheduler -> launcher) and a worker's failure (worker -> launcher and
scheduler). The unions they travel in are in protocol/messages.py."""
from __future__ import annotations

import msgspec


class DrainRequest(msgspec.Struct, tag="drain_request"):
    """From a client (POST /drain, `Client.drain`): drain as SIGTERM does; answered with the engine's stats.
    The frontend passes it on to the launcher, which runs it as on SIGTERM."""

    rid: str
    reason: str = "a client asked for a drain"


class Drain(msgspec.Struct, tag="drain"):
    """From the launcher: refuse new requests, and say `Drained` once none is left."""

    reason: str


class Drained(msgspec.Struct, tag="drained"):
    """From the frontend, while draining: no request is left."""


class Stalled(msgspec.Struct, tag="stalled"):
    """From the scheduler: the oldest step in flight has not come back within the step timeout."""

    step_id: int
    waited_s: float
    limit_s: float


class WorkerFailed(msgspec.Struct, tag="worker_failed"):
    """From a worker rank whose serving loop raised; the rank then waits to be stopped. The launcher names
    the cause the waiting calls get: this, or another process's death that the failure only echoes."""

    rank: int
    message: str  # the exception's first line

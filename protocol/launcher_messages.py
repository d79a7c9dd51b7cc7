"""What the children tell the launcher: the readiness handshake (Ready, Failed: protocol/messages.py), then
while serving, a stalled step (from the scheduler) and a drain asked for and done (from the frontend)."""
from __future__ import annotations

import msgspec

from protocol.messages import Failed, Ready


class Stalled(msgspec.Struct, tag="stalled"):
    """From the scheduler: the oldest step in flight has not come back within the step timeout."""

    step_id: int
    waited_s: float
    limit_s: float


class DrainRequested(msgspec.Struct, tag="drain_requested"):
    """From the frontend: a client asked for a drain (POST /drain); the launcher runs it as on SIGTERM."""

    reason: str


class Drained(msgspec.Struct, tag="drained"):
    """From the frontend, while draining: no request is left."""


LauncherMsg = Ready | Failed | Stalled | DrainRequested | Drained

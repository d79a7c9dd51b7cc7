"""The calls that open and close a session (frontend/client/session.py), answered by the scheduler's session
store (scheduler/sessions.py)."""
from __future__ import annotations

import msgspec

MAX_SESSION_TIMEOUT_S = 7 * 24 * 3600.0  # a session idle longer than a week is closed anyway
MAX_SESSION_TOKENS = 2**31 - 1  # far past any KV pool; bounds what crosses the socket


class OpenSession(msgspec.Struct, tag="open_session"):
    """Open a session that holds the KV of its turns, up to capacity_tokens, until closed or idle for
    timeout_s; answered with SessionReply (its id) or RequestError. rid names this call only."""

    rid: str
    capacity_tokens: int
    timeout_s: float


class CloseSession(msgspec.Struct, tag="close_session"):
    rid: str
    session_id: str


class SessionReply(msgspec.Struct, tag="session"):
    rid: str  # of the OpenSession / CloseSession call
    session_id: str
    opened: bool  # True: opened; False: closed

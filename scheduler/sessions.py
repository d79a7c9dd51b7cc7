"""Sessions (after SGLang's session-aware cache): the third source of a request's prefix, beside a device
hit and a host load. Socket-free; the scheduler owns one store and the tests drive it.

A session is opened with a capacity in tokens and an idle timeout. Each request of it that finishes (stop
or length) becomes a turn: its full context (prompt + output) and, locked in the prefix cache, the KV
of it. A later request of the session names a turn (by default the latest) and its prompt is appended
to that turn's context; its prefix is the turn's locked node, taken as it is (`KVCacheManager.
match_prefix(held=...)`), never re-matched, and no other traffic can take it from the session (with a host
tier the session keeps it there: its device copy may be evicted and is loaded back). A branch from an
earlier turn works the same way, from that turn.

Bounds: each session reserves its capacity when it opens, and the reservations of all open sessions
stay within the engine's cap (--session-kv-tokens); a session holds at most its capacity, letting go of
its oldest turns first (a continuation of a turn let go is matched in the radix tree like any prompt)
and holding only the first `capacity` tokens of a turn longer than that. A prompt already past the
capacity is refused. Closing a session, or its timeout (counted from its last request's end, never
while one runs), lets go of everything it holds.
"""
from __future__ import annotations

import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.protocol.errors import ErrorCode
from tandem.protocol.image_item import ImageItem
from tandem.protocol.messages import (
    CloseSession,
    OpenSession,
    RequestError,
    SessionParams,
    SessionReply,
)
from tandem.protocol.session_messages import MAX_SESSION_TIMEOUT_S
from tandem.scheduler.kv_cache import Hold, KVCacheManager
from tandem.scheduler.req import Req
from tandem.scheduler.tree_node import TreeNode

MAX_TURNS = 64  # turns a session remembers (to branch from); the oldest go first
REMEMBER_CLOSED = 4096  # ids of closed sessions kept to tell "closed" from "unknown"


class SessionError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Turn:
    rid: str
    tokens: list[int]  # its full context: what a continuation of it starts from
    hold: Hold | None  # the KV of it the session holds (locked); None: let go
    images: list[ImageItem] = field(default_factory=list)  # the context's, at their places in tokens
    lora: str | None = None  # the adapter its KV was computed under


@dataclass
class SessionState:
    id: str
    capacity: int
    timeout_s: float
    deadline: float
    turns: dict[str, Turn] = field(default_factory=dict)  # in the order they finished: the last is the latest
    active: int = 0  # requests of it in the engine: it does not time out under them

    @property
    def holds(self) -> list[Hold]:
        return [t.hold for t in self.turns.values() if t.hold is not None]


class SessionStore:
    def __init__(self, kv: KVCacheManager, cap_tokens: int, unavailable: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """cap_tokens: what all open sessions may reserve together. unavailable: why sessions cannot be
        opened at all (None: they can)."""
        self.kv, self.cap, self.unavailable, self.clock = kv, cap_tokens, unavailable, clock
        self.sessions: dict[str, SessionState] = {}
        self._closed: deque[str] = deque(maxlen=REMEMBER_CLOSED)

    @classmethod
    def for_engine(cls, kv: KVCacheManager, cap: int | None, prefix_cache: bool) -> SessionStore:
        """cap: --session-kv-tokens (None: half the pool)."""
        pool = kv.allocator.size
        cap = pool // 2 if cap is None else cap
        if cap >= pool:
            raise ValueError(
                f"invalid engine option session_kv_tokens={cap}: must be below the KV pool of {pool}"
            )
        if not prefix_cache:
            return cls(
                kv, 0, "sessions hold their KV in the prefix cache: the engine runs with --no-prefix-cache"
            )
        return cls(kv, cap, None if cap else "sessions are off (--session-kv-tokens 0)")

    # ---- the calls of the protocol --------------------------------------------------------------------
    def on_open(self, msg: OpenSession) -> SessionReply | RequestError:
        try:
            return SessionReply(msg.rid, self.open(msg.capacity_tokens, msg.timeout_s), True)
        except SessionError as e:
            return RequestError(msg.rid, e.code, e.message)

    def on_close(self, msg: CloseSession) -> SessionReply | RequestError:
        try:
            self.close(msg.session_id)
        except SessionError as e:
            return RequestError(msg.rid, e.code, e.message)
        return SessionReply(msg.rid, msg.session_id, False)

    @property
    def reserved(self) -> int:
        return sum(s.capacity for s in self.sessions.values())

    def holds(self) -> list[Hold]:
        """Every lock the sessions have (a node held twice is listed twice, as it is locked twice)."""
        return [h for s in self.sessions.values() for h in s.holds]

    def held_tokens(self) -> int:
        """Tokens whose KV the sessions hold, in either tier."""
        return _tokens(self.holds())

    # ---- open and close -----------------------------------------------------------------------------
    def open(self, capacity: int, timeout_s: float) -> str:
        if self.unavailable is not None:
            raise SessionError(ErrorCode.SESSION, self.unavailable)
        if capacity < 1:
            raise SessionError(ErrorCode.SESSION, f"capacity_tokens must be >= 1, got {capacity}")
        if not (0 < timeout_s <= MAX_SESSION_TIMEOUT_S) or math.isnan(timeout_s):
            raise SessionError(
                ErrorCode.SESSION, f"timeout must be in (0, {MAX_SESSION_TIMEOUT_S:.0f}] s, got {timeout_s}"
            )
        if self.reserved + capacity > self.cap:
            raise SessionError(
                ErrorCode.SESSION_CAPACITY,
                f"a session of {capacity} tokens is over the engine's cap: {self.reserved} of "
                f"{self.cap} tokens (--session-kv-tokens) are reserved by {len(self.sessions)} "
                f"open session(s)",
            )
        sid = uuid.uuid4().hex
        self.sessions[sid] = SessionState(sid, capacity, timeout_s, self.clock() + timeout_s)
        return sid

    def close(self, sid: str) -> None:
        s = self.get(sid)
        for t in s.turns.values():
            self._let_go(t)
        del self.sessions[sid]
        self._closed.append(sid)

    def expire(self) -> list[str]:
        """Close every session idle past its timeout; their ids."""
        now = self.clock()
        gone = [s.id for s in self.sessions.values() if not s.active and s.deadline <= now]
        for sid in gone:
            self.close(sid)
        return gone

    def next_deadline(self) -> float | None:
        """When the next idle session times out (clock time), None when none can."""
        return min((s.deadline for s in self.sessions.values() if not s.active), default=None)

    # ---- requests -----------------------------------------------------------------------------------
    def get(self, sid: str) -> SessionState:
        s = self.sessions.get(sid)
        if s is None:
            if sid in self._closed:
                raise SessionError(ErrorCode.SESSION_CLOSED, f"session {sid!r} is closed (or timed out)")
            raise SessionError(ErrorCode.SESSION_UNKNOWN, f"no session {sid!r}")
        return s

    def resolve(self, sp: SessionParams, prompt: list[int], max_tokens: int | None,
                context_len: int) -> tuple[tuple[SessionState, Turn | None], list[int]]:
        """The session and turn a request continues, and its whole prompt (the turn's context + prompt).
        Changes nothing: the caller starts the request with `begin` once every other check passed."""
        s = self.get(sp.id)
        if sp.rid is not None:
            turn = s.turns.get(sp.rid)
            if turn is None:
                raise SessionError(
                    ErrorCode.SESSION_TURN, f"session {sp.id!r} has no finished turn {sp.rid!r}"
                )
        else:
            turn = next(reversed(s.turns.values()), None)
        whole = (turn.tokens if turn is not None else []) + prompt
        if len(whole) > s.capacity:
            raise SessionError(
                ErrorCode.SESSION_CAPACITY,
                f"the prompt has {len(whole)} tokens with the turn it "
                f"continues; the session holds at most {s.capacity}",
            )
        if len(whole) + (max_tokens or 1) > context_len:  # the frontend checked the new part alone
            raise SessionError(
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {len(whole)} tokens with the turn it "
                f"continues; with max_tokens={max_tokens} it is over the context of {context_len}",
            )
        return (s, turn), whole

    def begin(self, req: Req, link: tuple[SessionState, Turn | None]) -> None:
        """req (from `resolve`) runs in its session: the session does not time out meanwhile."""
        s, req.session_turn = link
        req.session_id = s.id
        s.active += 1

    def end(self, req: Req, ok: bool, computed: int) -> None:
        """A request of a session ended; ok: it finished (stop or length) and becomes a turn. The KV
        manager's `release` has just cached its first `computed` tokens' KV: the session locks it."""
        assert req.session_id is not None
        s, rid, tokens = self.sessions.get(req.session_id), req.rid, req.fill_ids
        if s is None:
            return  # closed while the request ran: nothing to hold
        s.active -= 1
        s.deadline = self.clock() + s.timeout_s
        if not ok:
            return
        old = s.turns.pop(rid, None)  # a request id used again in the session: the newer turn wins
        if old is not None:
            self._let_go(old)
        held = self.kv.hold(req.key_ids[: min(computed, s.capacity)])  # the cache's key: images by digest
        s.turns[rid] = Turn(rid, tokens, held, req.images, req.lora)
        while len(s.turns) > MAX_TURNS:
            self._let_go(s.turns.pop(next(iter(s.turns))))
        for t in list(s.turns.values())[:-1]:  # over its capacity: the oldest turns go first
            if _tokens(s.holds) <= s.capacity:
                break
            self._let_go(t)

    def _let_go(self, t: Turn) -> None:
        if t.hold is not None:
            self.kv.unhold(t.hold)
            t.hold = None


def _tokens(holds: list[Hold]) -> int:
    """Tokens of the held nodes and their ancestors, each node once (the root has no key)."""
    seen: set[TreeNode] = set()
    for h in holds:
        cur: TreeNode | None = h.node
        while cur is not None and cur not in seen:
            seen.add(cur)
            cur = cur.parent
    return sum(len(n.key) for n in seen)

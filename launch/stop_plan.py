"""When `tandem serve` stops, why, and with which error for the calls still waiting: a socket-free state
machine that the serve loop feeds signals, the children's messages and the clock.

A drain (SIGTERM, SIGINT, POST /drain) lets the running requests finish while new ones are refused, for at
most drain_timeout_s; the rest are then aborted with DRAIN_TIMEOUT. A second signal during a drain, the
owner's death, a stall or a dead child stop the engine at once.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.protocol.errors import ErrorCode


@dataclass(frozen=True)
class Stop:
    reason: str  # what the calls still waiting are told
    code: str  # their error code (the engine_dead class)
    exit_code: int  # of `tandem serve`: 0 when it was asked to stop


class StopPlan:
    def __init__(self, drain_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self.draining: str | None = None  # the drain's reason, once one started
        self.deadline: float | None = None
        self.stop: Stop | None = None

    def request_drain(self, reason: str) -> bool:
        """Start a drain; True when it starts now (the frontend is to be told). With no drain time, stop."""
        if self.stop is not None or self.draining is not None:
            return False
        if self.drain_timeout_s <= 0:
            self.stop_now(reason)
            return False
        self.draining = reason
        self.deadline = self.clock() + self.drain_timeout_s
        return True

    def on_signal(self, reason: str) -> bool:
        """SIGTERM / SIGINT: the first drains; another one during the drain stops at once."""
        if self.draining is not None:
            self.stop_now(f"{reason} during the drain ({self.draining})")
            return False
        return self.request_drain(reason)

    def drained(self) -> None:
        """The frontend has no request left."""
        if self.draining is not None:
            self.stop_now(self.draining)

    def stop_now(self, reason: str, code: str = ErrorCode.ENGINE_DEAD, exit_code: int = 0) -> None:
        if self.stop is None:  # the first reason stands
            self.stop = Stop(reason, code, exit_code)

    def due(self) -> Stop | None:
        """The stop to carry out now, if any."""
        if self.stop is None and self.deadline is not None and self.clock() >= self.deadline:
            why = (
                f"{self.draining}: still running when the drain timeout ({self.drain_timeout_s:g} s) ran out"
            )
            self.stop_now(why, ErrorCode.DRAIN_TIMEOUT)
        return self.stop

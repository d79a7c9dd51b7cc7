"""A request's timeline in the scheduler, returned with its final output."""
from __future__ import annotations

import msgspec


class TimeStats(msgspec.Struct, array_like=True):
    """A request's timeline in the scheduler, wall-clock seconds (time.time(), comparable across
    processes on one host); 0.0 = not reached."""

    arrival: float = 0.0
    first_scheduled: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    retractions: list[float] = []

    @property
    def queue_s(self) -> float:
        return self.first_scheduled - self.arrival if self.first_scheduled else 0.0

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.arrival if self.first_token else 0.0

    @property
    def decode_s(self) -> float:
        return self.finished - self.first_token if self.first_token and self.finished else 0.0

    @property
    def e2e_s(self) -> float:
        return self.finished - self.arrival if self.finished else 0.0

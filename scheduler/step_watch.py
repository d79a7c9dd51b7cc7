"""Is the worker stalled? A step that never comes back (a rank stopped, a kernel spinning, a collective
waiting on a dead peer) would otherwise hang every waiting call, since nothing else notices it.

The clock runs while a step is in flight: from its send when the worker was idle, else from the previous
result (in the async pipeline the next step is queued before the worker starts it). Past the limit the
scheduler reports the stall once, to the launcher, which names the rank and stops the engine.
"""
from __future__ import annotations

# The default limit: generous against the slowest step seen, and never below a minute (a loaded machine
# can slow a step by far more than its usual spread without anything being wrong).
FLOOR_S = 60.0
STEP_FACTOR = 50.0


class StepWatch:
    def __init__(self, timeout_s: float | None, first_step_s: float) -> None:
        """timeout_s: the configured limit (None: from the step times); first_step_s: the limit until a step
        has finished (the first steps may compile kernels: the startup timeout covers them)."""
        self.timeout_s = timeout_s
        self.first_step_s = first_step_s
        self.longest_s = 0.0
        self.steps = 0
        self.since: float | None = None  # when the worker's current wait began; None: nothing in flight
        self.reported = False

    @property
    def limit_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        if self.steps == 0:
            return max(FLOOR_S, self.first_step_s)
        return max(FLOOR_S, STEP_FACTOR * self.longest_s)

    def sent(self, now: float) -> None:
        """A step went to the workers."""
        if self.since is None:
            self.since = now

    def result(self, now: float, still_in_flight: bool) -> None:
        """A step's result (or failure) came back."""
        if self.since is not None:
            self.longest_s = max(self.longest_s, now - self.since)
        self.steps += 1
        self.since = now if still_in_flight else None

    def overdue(self, now: float) -> float | None:
        """Seconds the oldest step in flight has waited, once past the limit and not reported yet."""
        if self.since is None or self.reported:
            return None
        waited = now - self.since
        if waited <= self.limit_s:
            return None
        self.reported = True
        return waited

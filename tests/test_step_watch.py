"""The stall detector's policy, driven with a fake clock: when a step in flight counts as stalled."""
from __future__ import annotations

from tandem.scheduler.step_watch import FLOOR_S, STEP_FACTOR, StepWatch


def test_a_configured_timeout_is_the_limit_and_the_stall_is_reported_once() -> None:
    w = StepWatch(timeout_s=2.0, first_step_s=300.0)
    assert w.overdue(100.0) is None  # nothing in flight: never stalled
    w.sent(100.0)
    assert w.overdue(101.9) is None
    assert w.overdue(102.5) == 2.5
    assert w.overdue(110.0) is None  # reported already


def test_the_default_limit_follows_the_longest_step_with_a_floor() -> None:
    w = StepWatch(timeout_s=None, first_step_s=300.0)
    assert w.limit_s == 300.0  # no step finished yet: the first may compile kernels
    w.sent(0.0)
    w.result(0.5, still_in_flight=False)
    assert w.limit_s == FLOOR_S  # 50 x 0.5 s is under the floor
    w.sent(10.0)
    w.result(13.0, still_in_flight=False)
    assert w.limit_s == STEP_FACTOR * 3.0
    w.sent(20.0)
    assert w.overdue(20.0 + STEP_FACTOR * 3.0 - 1) is None
    assert w.overdue(20.0 + STEP_FACTOR * 3.0 + 1) is not None


def test_the_clock_restarts_at_each_result_while_steps_remain_in_flight() -> None:
    w = StepWatch(timeout_s=5.0, first_step_s=300.0)
    w.sent(0.0)
    w.sent(1.0)  # the next step queued behind it (async scheduling): the clock still runs from 0
    w.result(4.0, still_in_flight=True)  # the first came back; the second's wait starts now
    assert w.overdue(8.5) is None
    assert w.overdue(9.5) == 5.5
    w.result(10.0, still_in_flight=False)
    assert w.since is None and w.longest_s == 6.0

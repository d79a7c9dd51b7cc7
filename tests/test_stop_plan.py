"""When `tandem serve` stops, why, and with which error: the StopPlan driven with a fake clock."""
from __future__ import annotations

from tandem.launch.stop_plan import Stop, StopPlan
from tandem.protocol.errors import ErrorCode


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_drain_ends_when_nothing_is_left_or_at_its_timeout() -> None:
    clock = _Clock()
    plan = StopPlan(10.0, clock)
    assert plan.on_signal("stopped (SIGTERM)") is True  # tell the frontend
    assert plan.request_drain("POST /drain") is False  # one drain at a time
    clock.t = 9.9
    assert plan.due() is None
    plan.drained()
    assert plan.due() == Stop("stopped (SIGTERM)", ErrorCode.ENGINE_DEAD, 0)

    clock = _Clock()
    plan = StopPlan(10.0, clock)
    assert plan.request_drain("POST /drain")
    clock.t = 10.0
    stop = plan.due()
    assert stop is not None and stop.code == ErrorCode.DRAIN_TIMEOUT and stop.exit_code == 0
    assert stop.reason.startswith("POST /drain: still running when the drain timeout (10 s) ran out")


def test_a_second_signal_or_no_drain_time_stops_at_once() -> None:
    plan = StopPlan(10.0, _Clock())
    plan.on_signal("stopped (SIGTERM)")
    assert plan.on_signal("stopped (SIGINT)") is False
    assert plan.due() == Stop(
        "stopped (SIGINT) during the drain (stopped (SIGTERM))", ErrorCode.ENGINE_DEAD, 0
    )

    plan = StopPlan(0.0, _Clock())
    assert plan.on_signal("stopped (SIGTERM)") is False
    assert plan.due() == Stop("stopped (SIGTERM)", ErrorCode.ENGINE_DEAD, 0)


def test_the_first_stop_stands() -> None:
    plan = StopPlan(10.0, _Clock())
    plan.stop_now("stalled", ErrorCode.STALLED, exit_code=1)
    plan.stop_now("the engine's owner process died")
    plan.drained()
    assert plan.due() == Stop("stalled", ErrorCode.STALLED, 1)
    assert plan.on_signal("stopped (SIGTERM)") is False

"""The launcher's reason for a stop after a worker's failure: a peer's death it only echoes wins, even one
reaped a moment after the report came; with none, the rank's own report."""
from __future__ import annotations

import time
from dataclasses import dataclass

from tandem.launch.failure_report import describe_death, describe_failure, first_death
from tandem.protocol.stop_messages import WorkerFailed


@dataclass
class Proc:
    name: str
    pid: int
    dies_at: float | None = None  # time.monotonic() from when exitcode reads `code`
    code: int = 0

    @property
    def exitcode(self) -> int | None:
        return self.code if self.dies_at is not None and time.monotonic() >= self.dies_at else None


GLOO = WorkerFailed(0, "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error")


def _engine(**dead: tuple[float, int]) -> list[Proc]:
    names = ["tandem-worker0", "tandem-worker1", "tandem-scheduler", "tandem-detokenizer", "tandem-frontend"]
    return [Proc(n, 100 + i, *dead.get(n.removeprefix("tandem-"), (None, 0))) for i, n in enumerate(names)]


def test_a_killed_peer_is_named_instead_of_the_echo() -> None:
    procs = _engine(worker1=(0.0, -9))
    assert describe_failure(GLOO, procs) == "tandem-worker1 (pid 101) exited with code -9 (SIGKILL)"


def test_a_death_reaped_after_the_report_is_still_found() -> None:
    procs = _engine(worker1=(time.monotonic() + 0.2, 1))
    assert describe_failure(GLOO, procs, wait_s=5.0) == "tandem-worker1 (pid 101) exited with code 1"


def test_with_no_death_the_report_itself_is_the_reason() -> None:
    t0 = time.monotonic()
    assert describe_failure(GLOO, _engine(), wait_s=0.1) == f"worker 0 failed: {GLOO.message}"
    assert time.monotonic() - t0 >= 0.1  # it waited for an echoed death before believing the report


def test_the_reporting_rank_is_not_its_own_cause() -> None:
    procs = _engine(worker0=(0.0, 1))
    assert describe_failure(GLOO, procs, wait_s=0.05) == f"worker 0 failed: {GLOO.message}"


def test_a_death_by_signal_comes_before_one_that_exited() -> None:
    procs = _engine(scheduler=(0.0, 1), worker1=(0.0, -15))
    assert first_death(procs) is procs[1]
    assert describe_death(procs[1]) == "tandem-worker1 (pid 101) exited with code -15 (SIGTERM)"
    assert first_death(_engine()) is None
    assert first_death(_engine(frontend=(0.0, 2))).name == "tandem-frontend"

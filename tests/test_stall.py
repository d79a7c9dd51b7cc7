"""A step that never comes back is found: a worker rank stopped with SIGSTOP mid-request (alone, or as the
peer that rank 0 waits for in a collective) ends every waiting call with a typed EngineDeadError naming the
rank and the stall, within --step-timeout-s, and the launcher stops the engine with nothing left behind.
(A rank killed mid-step: tests/test_e2e_tp.py, test_killing_rank_1_stops_the_engine.)"""
from __future__ import annotations

import os
import signal
import time

import pytest

from tandem import Client, EngineDeadError, SamplingParams
from tandem.protocol.errors import ErrorCode
from tests.test_lifecycle import _children, _serve, assert_left_last, start_long_stream

STEP_TIMEOUT_S = 3.0


def _stop_rank_mid_request(model, victim: str, *flags: str) -> None:
    proc, endpoint, pids = _serve(model, "--step-timeout-s", str(STEP_TIMEOUT_S), *flags)
    kids = _children(proc.pid)
    try:
        client = Client(endpoint)
        # Warm: the first steps may compile kernels, which the small test timeout is not meant to cover.
        client.generate([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        t, errors = start_long_stream(client, 1800)
        os.kill(pids[victim], signal.SIGSTOP)
        stopped_at = time.monotonic()
        t.join(STEP_TIMEOUT_S + 60)  # a hang guard: the error must come from the stall detector
        assert not t.is_alive(), "the client still waits on a stalled worker"
        waited = time.monotonic() - stopped_at
        assert errors and isinstance(errors[0], EngineDeadError), errors
        e = errors[0]
        assert e.code == ErrorCode.STALLED, (e.code, str(e))
        rank = int(victim.removeprefix("tandem-worker"))
        assert f"worker rank {rank} (pid {pids[victim]}) is stopped" in str(e), str(e)
        assert f"--step-timeout-s {STEP_TIMEOUT_S:g}" in str(e), str(e)
        assert waited >= STEP_TIMEOUT_S * 0.9, f"reported after {waited:.1f} s, before the timeout"
        assert proc.wait(30) != 0  # a stall is a failure: a supervisor should restart it
        assert_left_last(proc, kids)
        client.close()
    finally:
        for k in kids:  # a failed check above must not leave a stopped process behind
            if k.is_running():
                k.kill()
        if proc.poll() is None:
            proc.kill()


def test_a_stopped_worker_is_found_within_the_step_timeout(tiny_model) -> None:
    _stop_rank_mid_request(tiny_model("llama"), "tandem-worker0")


@pytest.mark.slow  # ~6 s: the fast tier (`make test`) keeps under its 10 minutes
def test_a_tp_rank_stopped_mid_collective_is_named(tiny_model) -> None:
    # Rank 0 waits in an all-reduce for its stopped peer: the step never comes back either way.
    _stop_rank_mid_request(tiny_model("llama"), "tandem-worker1", "--tp-size", "2")

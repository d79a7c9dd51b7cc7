"""Per-request failure: an exception attributable to one request fails it alone with a typed error,
frees its KV once, and the other requests of the step finish with the same tokens as without the fault.
First the scheduler against the fake worker, then the whole engine with faults injected in the worker
and in the scheduler (TANDEM_INJECT_FAULT)."""
from __future__ import annotations

import threading

import pytest

from tandem.protocol import fault_injection
from tandem.protocol.errors import RequestFailedError
from tandem.protocol.messages import TokenizedRequest
from tandem.protocol.sampling_params import SamplingParams
from tests.conftest import check_idle_engine
from tests.fake_worker import FaultyWorker, expected_output
from tests.test_scheduler_core import make, run

MARKER = 96  # a token of the fake vocab that only the faulty request's prompt holds


def _requests(n: int, faulty: int | None) -> list[TokenizedRequest]:
    reqs = []
    for i in range(n):
        prompt = [1 + (i * 7 + j) % 90 for j in range(5 + 3 * i)]
        if i == faulty:
            prompt[2] = MARKER
        reqs.append(TokenizedRequest(f"r{i}", prompt, SamplingParams(max_tokens=12 + i, ignore_eos=True)))
    return reqs


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("faulty", [0, 3])
def test_worker_step_fault_fails_one_request(depth: int, faulty: int) -> None:
    sched, inner = make(depth=depth, budget=64, chunk=16)
    worker = FaultyWorker(inner, MARKER)
    reqs = _requests(6, faulty)
    for r in reqs:
        sched.add_request(r)

    late: list[TokenizedRequest] = []

    def add_late(step: int) -> None:  # the engine serves a request that arrives after the fault
        if step == 8:
            late.append(TokenizedRequest("late", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
            sched.add_request(late[0])

    outputs, ends = run(sched, worker, depth, on_step=add_late)  # asserts no KV or row leak at the end
    assert worker.failed
    assert ends[f"r{faulty}"] == ("error", "request_failed.internal")
    for r in [*reqs, *late]:
        if r.rid != f"r{faulty}":
            want = expected_output(r.input_ids, r.params.max_tokens)
            assert outputs[r.rid] == want, r.rid
            assert ends[r.rid] == ("length", None)
    assert sched.stats.failed == 1


@pytest.mark.parametrize("depth", [1, 2])
def test_unattributed_step_fault_fails_every_request_of_that_step(depth: int) -> None:
    sched, inner = make(depth=depth, budget=64, chunk=16)
    worker = FaultyWorker(inner, MARKER, name_culprit=False)
    reqs = _requests(6, faulty=4)
    by_prompt = {tuple(r.input_ids): r.rid for r in reqs}
    for r in reqs[:3]:  # these run first; the faulty one and two more join them later
        sched.add_request(r)

    def add_rest(step: int) -> None:
        if step == 6:
            for r in reqs[3:]:
                sched.add_request(r)

    outputs, ends = run(sched, worker, depth, on_step=add_rest)
    rid_of_row: dict[int, str] = {}
    for so in inner.steps:
        rid_of_row.update(
            {r.req_pool_idx: by_prompt[tuple(r.token_ids[: r.num_prompt])] for r in so.new_reqs}
        )
        if so.step_id == worker.failed[0].step_id:
            break
    in_step = {rid_of_row[s.req_pool_idx] for s in worker.failed[0].scheduled}
    assert "r4" in in_step and len(in_step) > 1
    assert {rid for rid, (kind, _) in ends.items() if kind == "error"} == in_step
    for r in reqs:
        if r.rid not in in_step:
            assert outputs[r.rid] == expected_output(r.input_ids, r.params.max_tokens)


@pytest.mark.parametrize("depth", [1, 2])
def test_scheduler_commit_fault_fails_one_request(depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fault_injection, "_FAULTS", {"scheduler.commit": MARKER})
    monkeypatch.setattr(fault_injection, "ARMED", True)  # as TANDEM_INJECT_FAULT set at start would
    sched, worker = make(depth=depth)
    reqs = _requests(4, faulty=1)
    for r in reqs:
        sched.add_request(r)
    outputs, ends = run(sched, worker, depth)
    assert ends["r1"] == ("error", "request_failed.internal")
    for r in reqs:
        if r.rid != "r1":
            assert outputs[r.rid] == expected_output(r.input_ids, r.params.max_tokens)


def test_injection_spec_is_checked() -> None:
    assert fault_injection._parse("worker.step:7, scheduler.commit:9") == {
        "worker.step": 7,
        "scheduler.commit": 9,
    }
    with pytest.raises(ValueError, match="SITE:TOKEN"):
        fault_injection._parse("worker:x")


# ---- the whole engine ---------------------------------------------------------------------------------
WORKER_MARK, SCHED_MARK = 991, 992


def test_engine_survives_injected_faults(tiny_model, launch_client, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem import Client

    monkeypatch.setenv(fault_injection.ENV, f"worker.step:{WORKER_MARK},scheduler.commit:{SCHED_MARK}")
    client = launch_client(tiny_model("llama"), chunked_prefill_tokens=32)
    prompts = [[3 + (i * 37 + j * 11) % 900 for j in range(4 + 9 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in client.generate_batch(prompts, greedy, progress=False)]

    got: list = []
    batch = threading.Thread(
        target=lambda: got.append(client.generate_batch(prompts, greedy, progress=False))
    )
    batch.start()
    other = Client(client.endpoint)  # a second client: the faulty requests run beside the batch
    try:
        for mark in (WORKER_MARK, SCHED_MARK):
            with pytest.raises(RequestFailedError, match="injected fault") as err:
                other.generate([5, mark, 6] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
            assert err.value.code == "request_failed.internal"
    finally:
        batch.join(timeout=120)
        other.close()
    assert [o.token_ids for o in got[0]] == alone
    assert client.generate(prompts[0], greedy).token_ids == alone[0]
    check_idle_engine(client)

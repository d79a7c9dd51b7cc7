"""Host-tier loads count against the step's token budget (ceil(L / HOST_LOAD_DIVISOR) for L tokens), against
the fake worker: a load shrinks the prefill beside it, a load that does not fit waits for the next step, and
a load bigger than a whole step still runs, first in its step."""
from __future__ import annotations

import dataclasses
import random

from tandem.protocol.messages import SchedulerOutput
from tandem.scheduler.prefill import HOST_LOAD_DIVISOR
from tandem.scheduler.scheduler import Scheduler
from tests.fake_worker import VOCAB, FakeWorker, expected_output
from tests.test_host_kv_scheduler import idle_accounting, make
from tests.test_scheduler_core import req, run


def _evicted(budget: int) -> tuple[Scheduler, FakeWorker, list[int]]:
    """A 64-token prompt cached, then pushed out of the 128-slot device pool into the host tier; then the
    step budget set to `budget`."""
    sched, worker = make(128, 1024)
    rng = random.Random(11)
    prompt = [rng.randrange(1, VOCAB) for _ in range(64)]
    sched.add_request(req("first", prompt, max_tokens=2))
    run(sched, worker, 1)
    sched.add_request(req("other", [rng.randrange(1, VOCAB) for _ in range(120)], max_tokens=2))
    run(sched, worker, 1)
    assert sched.kv.tree.match_prefix(prompt).host_hit_length == 64
    sched.cfg = dataclasses.replace(sched.cfg, max_num_batched_tokens=budget)
    return sched, worker, prompt


def _tokens(sched: Scheduler, so: SchedulerOutput) -> dict[str, int]:
    rows = {r.req_pool_idx: rid for rid, r in sched.reqs.items()}
    return {rows[s.req_pool_idx]: s.num_tokens for s in so.scheduled}


def _loaded(so: SchedulerOutput) -> int:
    return 0 if so.kv_copies is None else len(so.kv_copies.to_device_src)


def test_a_load_shrinks_the_prefill_beside_it() -> None:
    sched, worker, prompt = _evicted(budget=64)
    sched.add_request(req("again", prompt + [5] * 16, max_tokens=2))  # 64 loaded, 16 computed
    fresh = [7] * 60
    sched.add_request(req("fresh", fresh, max_tokens=2))
    so = sched.schedule()
    assert so is not None and _loaded(so) == 64
    cost = 64 // HOST_LOAD_DIVISOR
    assert _tokens(sched, so) == {"again": 16, "fresh": 64 - cost - 16}, (
        "the load's cost comes off the budget"
    )
    sched.commit(worker.execute(so))
    outputs, _ = run(sched, worker, 1)
    assert outputs["again"] == expected_output(prompt + [5] * 16, 2)
    assert outputs["fresh"] == expected_output(fresh, 2)
    idle_accounting(sched)


def test_a_load_that_does_not_fit_waits_for_the_next_step() -> None:
    sched, worker, prompt = _evicted(budget=24)
    fresh = [9] * 22
    sched.add_request(req("fresh", fresh, max_tokens=2))  # leaves 2 budget tokens, the load costs 4
    sched.add_request(req("again", prompt + [5] * 4, max_tokens=2))
    so = sched.schedule()
    assert so is not None and _tokens(sched, so) == {"fresh": 22} and _loaded(so) == 0
    assert sched.reqs["again"].req_pool_idx is None and sched.kv.tree.protected_size == 0, "match undone"
    sched.commit(worker.execute(so))
    so = sched.schedule()
    assert so is not None and _loaded(so) == 64 and _tokens(sched, so) == {"fresh": 1, "again": 4}
    sched.commit(worker.execute(so))
    outputs, _ = run(sched, worker, 1)
    assert outputs["again"] == expected_output(prompt + [5] * 4, 2)
    idle_accounting(sched)


def test_a_load_bigger_than_the_step_goes_first_in_its_step() -> None:
    sched, worker, prompt = _evicted(budget=3)  # the load costs 4 > 3: it would never fit beside anything
    sched.add_request(req("again", prompt + [5, 6], max_tokens=3))
    sched.add_request(req("fresh", [8, 8], max_tokens=2))
    so = sched.schedule()
    assert so is not None and _loaded(so) == 64
    assert _tokens(sched, so) == {"again": 1}, "one token computed beside the load, nothing else admitted"
    sched.commit(worker.execute(so))
    outputs, _ = run(sched, worker, 1)
    assert outputs["again"] == expected_output(prompt + [5, 6], 3)
    assert outputs["fresh"] == expected_output([8, 8], 2)
    assert sched.kv.host_hit_tokens == 64
    idle_accounting(sched)

"""--scheduling-policy: the policy object alone (queue order, victims), then the scheduler with it against
the fake worker: admission by (priority, arrival), retraction of the lowest priority first, FCFS among
equals (no starvation), fcfs ignoring priorities, and the tokens of every policy equal."""
from __future__ import annotations

import random

import pytest

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import TokenizedRequest
from tandem.protocol.model_info import ModelInfo
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.req import Req
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.scheduling_policy import FcfsPolicy, PriorityPolicy, make_policy
from tests.fake_worker import VOCAB, FakeWorker, expected_output
from tests.test_scheduler_core import run


def _req(rid: str, priority: int, arrival: int, outputs: int = 0) -> Req:
    r = Req(rid, [1, 2], SamplingParams(), frozenset(), 8, arrival, priority)
    r.output_ids = [3] * outputs
    r.req_pool_idx = arrival  # holds a row, nothing in flight: a retraction candidate
    return r


def test_priority_queue_orders_by_priority_then_arrival_and_requeues_in_place() -> None:
    q = PriorityPolicy()
    reqs = [_req("a", 1, 0), _req("b", 0, 1), _req("c", 1, 2), _req("d", -3, 3), _req("e", 0, 4)]
    for r in reqs:
        q.add(r)
    assert [r.rid for r in q] == ["d", "b", "e", "a", "c"]
    assert q.pop().rid == "d" and q.pop().rid == "b"
    q.requeue(reqs[1])  # b retracted: back ahead of e (it arrived first), not at the head of everything
    q.requeue(reqs[3])
    assert [r.rid for r in q] == ["d", "b", "e", "a", "c"]
    q.remove(reqs[4])
    assert [r.rid for r in q] == ["d", "b", "a", "c"] and reqs[2] in q and reqs[4] not in q


def test_fcfs_queue_ignores_priority_and_requeues_at_the_head() -> None:
    q = make_policy("fcfs")
    assert isinstance(q, FcfsPolicy)
    reqs = [_req("a", 5, 0), _req("b", -5, 1), _req("c", 0, 2)]
    for r in reqs:
        q.add(r)
    assert [r.rid for r in q] == ["a", "b", "c"]
    q.requeue(_req("z", 9, 7))
    assert q.peek() is not None and q.peek().rid == "z"
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_policy("lifo")


def test_priority_victim_is_lowest_priority_latest_arrival_and_never_served_before_the_grower() -> None:
    p = PriorityPolicy()
    grower = _req("g", 1, 5)
    running = [_req("hi", 0, 9), _req("old", 2, 1), _req("new", 2, 7), _req("mid", 1, 8), grower]
    assert p.victim(running, grower).rid == "new"
    running[2].num_inflight_steps = 1  # a step of it is in flight: not a candidate
    assert p.victim(running, grower).rid == "old"
    # Only requests served after the grower: equal priority and a later arrival, or a lower priority.
    assert p.victim([running[0], grower], grower) is None
    assert p.victim([_req("same", 1, 4), grower], grower) is None
    assert p.victim([_req("later", 1, 6), grower], grower).rid == "later"
    # fcfs: fewest outputs, then the latest arrival, whatever the priorities.
    f = FcfsPolicy()
    assert f.victim([_req("x", -9, 1, outputs=0), _req("y", 9, 2, outputs=4), grower], grower).rid == "x"
    assert p.running_order(running)[0].rid == "hi" and f.running_order(running)[0].rid == "hi"
    assert [r.rid for r in p.running_order(running)][1:3] == ["g", "mid"]


def make(policy: str, slots: int = 4096, budget: int = 256, max_running: int = 64, page: int = 1):
    cfg = EngineConfig(model="x", max_num_batched_tokens=budget, max_running_requests=max_running,
                       async_scheduling=False, page_size=page, scheduling_policy=policy)
    info = ModelInfo(vocab_size=VOCAB, max_model_len=512, eos_token_ids=[0], architecture="fake")
    return Scheduler(cfg, info, slots), FakeWorker(slots + page - 1)


def _tr(rid: str, prompt: list[int], priority: int = 0, **kw) -> TokenizedRequest:
    kw.setdefault("ignore_eos", True)
    return TokenizedRequest(rid, prompt, SamplingParams(**kw), priority)


def _admission_order(sched: Scheduler, worker: FakeWorker) -> tuple[list[str], dict]:
    order: list[str] = []

    def on_step(_: int) -> None:
        for r in sched.running:
            if r.rid not in order:
                order.append(r.rid)

    outputs, ends = run(sched, worker, 1, on_step)
    return order, outputs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_follows_the_policy_with_one_running_slot(policy: str) -> None:
    sched, worker = make(policy, max_running=1)
    prios = [3, 1, 2, 1, 0, 3, 0]
    for i, pr in enumerate(prios):
        sched.add_request(_tr(f"r{i}", [i + 1, 7, 9], pr, max_tokens=3))
    order, outputs = _admission_order(sched, worker)
    if policy == "fcfs":
        assert order == [f"r{i}" for i in range(len(prios))]
    else:  # by priority, then arrival
        assert order == ["r4", "r6", "r1", "r3", "r2", "r0", "r5"]
    assert outputs == {f"r{i}": expected_output([i + 1, 7, 9], 3) for i in range(len(prios))}


def test_equal_priorities_are_served_first_come_first_served_while_more_keep_arriving() -> None:
    """A stream of equal-priority requests, two running at a time: each is admitted in arrival order, so
    none is overtaken by a later one and none waits forever."""
    sched, worker = make("priority", max_running=2)
    arrived = 0
    order: list[str] = []

    def on_step(step: int) -> None:
        nonlocal arrived
        if step % 2 == 0 and arrived < 30:  # faster than they are served: the queue never drains early
            sched.add_request(_tr(f"r{arrived}", [arrived % 50 + 1, 3], 5, max_tokens=4))
            arrived += 1
        for r in sched.running:
            if r.rid not in order:
                order.append(r.rid)

    sched.add_request(_tr("first", [9, 9], 5, max_tokens=4))
    outputs, ends = run(sched, worker, 1, on_step)
    assert order == ["first"] + [f"r{i}" for i in range(30)]
    assert len(ends) == 31 and all(e == ("length", None) for e in ends.values())


def test_kv_pressure_retracts_the_lowest_priority_latest_arrival_first() -> None:
    """Six requests decode in a pool too small for all: whenever one must go, it is the lowest priority (the
    latest among equals); the high-priority ones are never retracted and every output is unchanged."""
    prios = [2, 0, 2, 1, 0, 1]
    prompts = [[i + 1] * 10 for i in range(len(prios))]
    sched, worker = make("priority", slots=6 * 10 + 40, budget=512)
    for i, (p, pr) in enumerate(zip(prompts, prios)):
        sched.add_request(_tr(f"r{i}", p, pr, max_tokens=30))
    reqs = dict(sched.reqs)
    retracted: list[str] = []
    seen: dict[str, int] = {}

    def on_step(_: int) -> None:
        for rid, r in reqs.items():
            n = len(r.time_stats.retractions)
            if n > seen.get(rid, 0):
                retracted.extend([rid] * (n - seen.get(rid, 0)))
                seen[rid] = n

    outputs, _ = run(sched, worker, 1, on_step)
    assert outputs == {f"r{i}": expected_output(p, 30) for i, p in enumerate(prompts)}
    assert retracted, "the pool was meant to run short"
    assert retracted[0] == "r2", retracted  # priority 2, and the later of the two
    assert not {"r1", "r4"} & set(retracted), retracted


def test_fcfs_and_priority_give_the_same_tokens_under_kv_pressure() -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(24)]
    want = {f"r{i}": expected_output(p, 20) for i, p in enumerate(prompts)}
    for policy in ("fcfs", "priority"):
        sched, worker = make(policy, slots=sum(len(p) + 20 for p in prompts) // 4, budget=128)
        for i, p in enumerate(prompts):
            sched.add_request(_tr(f"r{i}", p, rng.randrange(-2, 3), max_tokens=20))
        outputs, _ = run(sched, worker, 1)
        assert outputs == want, policy
        assert sched.stats.retractions > 0, policy


def test_bad_policy_and_session_cap_options_are_errors_naming_them() -> None:
    for opts, name in (({"scheduling_policy": "lifo"}, "scheduling_policy"), ({"session_kv_tokens": -1},
                       "session_kv_tokens"), ({"scheduling_policy": 1}, "scheduling_policy")):
        with pytest.raises(ValueError, match=f"invalid engine option.*{name}"):
            EngineConfig.from_options("m", **opts)
    assert EngineConfig.from_options("m", scheduling_policy="priority").scheduling_policy == "priority"

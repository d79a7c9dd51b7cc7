"""Request timing (TimeStats on Req) and the engine load that rides with every output, at the scheduler."""
from __future__ import annotations

import random

from tandem.protocol.messages import TokenBatch, TokenDelta
from tests.fake_worker import VOCAB
from tests.test_scheduler_core import make, req, run


def _collect_finals(sched) -> list[TokenDelta]:
    finals: list[TokenDelta] = []
    take = sched.take_outbox

    def take_and_note() -> list:
        out = take()
        for m in out:
            if isinstance(m, TokenBatch):
                assert all(d.load is not None for d in m.deltas)
                finals.extend(d for d in m.deltas if d.finish_reason is not None)
        return out

    sched.take_outbox = take_and_note
    return finals


def test_timeline_and_retractions_under_kv_pressure() -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(30)]
    sched, worker = make(slots=160, depth=2, budget=128)
    finals = _collect_finals(sched)
    for i, p in enumerate(prompts):
        sched.add_request(req(f"r{i}", p, max_tokens=24))
    run(sched, worker, 2)
    assert len(finals) == 30 and sched.stats.retractions > 0
    for d in finals:
        t = d.final.time_stats
        assert 0 < t.arrival <= t.first_scheduled <= t.first_token <= t.finished
        assert all(t.first_scheduled <= r <= t.finished for r in t.retractions)
    # Every retraction is on some request's timeline, and in the load's preemption total.
    assert sum(len(d.final.time_stats.retractions) for d in finals) == sched.stats.retractions
    last = finals[-1].load
    assert last.preemptions == sched.stats.retractions and last.running == 0 and last.waiting == 0


def test_prefix_cache_hits_are_counted() -> None:
    sched, worker = make(slots=4096)
    finals = _collect_finals(sched)
    prompt = list(range(1, 41))
    sched.add_request(req("a", prompt, max_tokens=4))
    run(sched, worker, 1)
    sched.add_request(req("b", prompt[:30] + [50, 51], max_tokens=4))
    run(sched, worker, 1)
    a, b = finals
    assert a.cached_tokens == 0 and b.cached_tokens == 30
    assert b.load.prefix_queries == 40 + 32 and b.load.prefix_hits == 30

"""The scheduler's state machine against a fake worker: token accounting, finishing, aborts,
retraction and KV integrity, step by step, synchronous and with a step in flight."""
from __future__ import annotations

import random

import pytest

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import RequestError, SampleStep, TokenBatch, TokenizedRequest
from tandem.protocol.model_info import ModelInfo
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.req import KVPopError, Req
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.step_driver import StepDriver
from tests.fake_worker import VOCAB, FakeWorker, expected_output, true_drafts


def make(slots: int = 4096, depth: int = 1, budget: int = 256, max_running: int = 64, max_len: int = 512,
         page: int = 1, cache: bool = True, chunk: int | None = None, spec: int = 0, drafter=true_drafts):
    cfg = EngineConfig(
        model="x",
        max_num_batched_tokens=budget,
        max_running_requests=max_running,
        async_scheduling=depth == 2,
        page_size=page,
        prefix_cache=cache,
        chunked_prefill_tokens=chunk,
        speculative_method="ngram" if spec else None,
        num_speculative_tokens=spec or 4,
    )
    info = ModelInfo(vocab_size=VOCAB, max_model_len=max_len, eos_token_ids=[0], architecture="fake")
    return Scheduler(cfg, info, slots), FakeWorker(slots + page - 1, drafter=drafter, k=spec)


def run(sched: Scheduler, worker: FakeWorker, depth: int, on_step=None, max_steps: int = 10_000):
    """Drive the real pipeline driver (as the scheduler process does) against the fake worker: up to
    `depth` steps in flight, in-order commits, one result committed per iteration."""
    driver = StepDriver(sched, depth)
    outputs: dict[str, list[int]] = {}
    ends: dict[str, tuple[str, object]] = {}
    queue: list = []
    deferred: dict = {}  # step id -> its result, held until its SampleStep (structured output)

    def send(msgs) -> None:
        for m in msgs:
            if isinstance(m, SampleStep):
                queue.append(deferred.pop(m.step_id))
            elif m.defer_sample:
                deferred[m.step_id] = worker.execute(m)
            else:
                queue.append(worker.execute(m))

    for step in range(max_steps):
        send(driver.pump())
        if on_step:
            on_step(step)
        if queue:
            send(driver.on_result(queue.pop(0)))
        sched.check_integrity()
        for msg in driver.take_outbox():
            if isinstance(msg, TokenBatch):
                for d in msg.deltas:
                    outputs.setdefault(d.rid, []).extend(d.token_ids)
                    if d.finish_reason is not None:
                        assert d.rid not in ends, f"{d.rid} ended twice"
                        ends[d.rid] = (d.finish_reason, d.matched_stop)
            elif isinstance(msg, RequestError):
                assert msg.rid not in ends, f"{msg.rid} ended twice"
                ends[msg.rid] = ("error", msg.code)
        if not sched.has_work and not sched.inflight and not queue:
            break
    else:
        raise AssertionError(f"not done after {max_steps} steps")
    # At idle every slot is free or in the prefix cache, unlocked (evictable).
    assert sched.kv.tree.protected_size == 0, "a finished request still locks the cache"
    assert sched.kv.available_slots == sched.kv.allocator.size, "KV leaked"
    assert sched.kv.req_table.num_free == sched.kv.req_table.max_reqs, "request rows leaked"
    return outputs, ends


def req(rid: str, prompt: list[int], **kw) -> TokenizedRequest:
    kw.setdefault("ignore_eos", True)
    return TokenizedRequest(rid, prompt, SamplingParams(**kw))


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_max_tokens_schedules_exactly_prompt_plus_max_minus_one(depth: int, max_tokens: int) -> None:
    sched, worker = make(depth=depth)
    prompt = [5, 6, 7, 8]
    sched.add_request(req("a", prompt, max_tokens=max_tokens))
    outputs, ends = run(sched, worker, depth)
    assert outputs["a"] == expected_output(prompt, max_tokens)
    assert ends["a"] == ("length", None)
    total = sum(s.num_tokens for so in worker.steps for s in so.scheduled)
    assert total == len(prompt) + max_tokens - 1


@pytest.mark.parametrize("depth", [1, 2])
def test_eos_overrun_is_dropped(depth: int) -> None:
    sched, worker = make(depth=depth)
    prompt = [11, 12, 13]
    want = expected_output(prompt, 40)
    stop = want[4]
    sched.add_request(req("a", prompt, max_tokens=40, stop_token_ids=[stop]))
    outputs, ends = run(sched, worker, depth)
    assert outputs["a"] == want[: want.index(stop) + 1]
    assert ends["a"] == ("stop", stop)
    computed = sum(s.num_tokens for so in worker.steps for s in so.scheduled)
    # At most one step past the stop token is computed, never returned.
    assert computed - (len(prompt) + len(outputs["a"]) - 1) <= (depth - 1)


@pytest.mark.parametrize("depth", [1, 2])
def test_many_requests_chunked_budget_match_reference(depth: int) -> None:
    rng = random.Random(0)
    sched, worker = make(depth=depth, budget=64, max_running=8)
    want = {}
    for i in range(30):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 150))]
        n = rng.randrange(1, 20)
        sched.add_request(req(f"r{i}", prompt, max_tokens=n))
        want[f"r{i}"] = expected_output(prompt, n)
    outputs, ends = run(sched, worker, depth)
    assert outputs == want
    assert all(e[0] == "length" for e in ends.values()) and len(ends) == 30


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("abort_at", [0, 1, 2, 3, 5, 8])
def test_abort_at_staggered_steps(depth: int, abort_at: int) -> None:
    sched, worker = make(depth=depth, budget=16)
    abort_long_at(sched, worker, depth, abort_at)


def abort_long_at(sched: Scheduler, worker: FakeWorker, depth: int, abort_at: int) -> None:
    """A long request (prefilled over 3 steps at budget 16) aborted at step abort_at beside a short one:
    the long one ends `abort` with a prefix of its output, the short one is untouched."""
    sched.add_request(req("long", list(range(1, 40)), max_tokens=30))
    sched.add_request(req("other", [3, 4], max_tokens=12))

    def on_step(step: int) -> None:
        if step == abort_at:
            sched.abort("long")

    outputs, ends = run(sched, worker, depth, on_step)
    assert ends["long"][0] == "abort"
    got = outputs.get("long", [])
    assert got == expected_output(list(range(1, 40)), 30)[: len(got)]
    assert outputs["other"] == expected_output([3, 4], 12)


def test_abort_while_queued_and_unknown_rid() -> None:
    sched, worker = make(max_running=1)
    sched.add_request(req("a", [1, 2], max_tokens=5))
    sched.add_request(req("b", [1, 2], max_tokens=5))
    sched.abort("b")  # still waiting: ends at once
    sched.abort("nope")  # unknown: ignored
    outputs, ends = run(sched, worker, 1)
    assert ends["b"][0] == "abort" and outputs.get("b", []) == []
    assert ends["a"] == ("length", None)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("page,cache", [(1, True), (16, True), (1, False), (16, False)])
def test_kv_pressure_retracts_and_matches_unconstrained(depth: int, page: int, cache: bool) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(40)]
    want = {f"r{i}": expected_output(p, 24) for i, p in enumerate(prompts)}
    need = sum(len(p) + 24 for p in prompts)
    sched, worker = make(slots=max(need // 8, 16 * page), depth=depth, budget=128, page=page, cache=cache)
    for i, p in enumerate(prompts):
        sched.add_request(req(f"r{i}", p, max_tokens=24))
    outputs, ends = run(sched, worker, depth)
    assert outputs == want
    assert sched.stats.retractions > 0
    assert all(e == ("length", None) for e in ends.values())


def test_request_that_cannot_fit_alone_errors_instead_of_looping() -> None:
    sched, worker = make(slots=32)
    sched.add_request(req("big", list(range(1, 20)), max_tokens=100))
    sched.add_request(req("huge", list(range(1, 60)), max_tokens=5))
    outputs, ends = run(sched, worker, 1)
    assert ends["huge"] == ("error", "request_failed.kv_capacity")
    assert ends["big"] == ("error", "request_failed.kv_capacity")
    assert len(outputs["big"]) == 32 - 19 + 1


def test_kv_pop_twice_raises() -> None:
    sched, _ = make()
    sched.add_request(req("a", [1, 2, 3], max_tokens=2))
    r = sched.reqs["a"]
    r.pop_committed_kv_cache()
    with pytest.raises(KVPopError):
        r.pop_committed_kv_cache()
    r.pop_overallocated_kv_cache()
    with pytest.raises(KVPopError):
        r.pop_overallocated_kv_cache()


@pytest.mark.parametrize("depth", [1, 2])
def test_new_request_joins_next_step(depth: int) -> None:
    sched, worker = make(depth=depth)
    sched.add_request(req("a", [1, 2, 3], max_tokens=10))
    first = sched.schedule()
    assert first is not None
    results = [worker.execute(first)]
    sched.add_request(req("b", [4, 5], max_tokens=3))
    if depth == 2:
        # Arrived before N+1 was scheduled: joins N+1 while N is still in flight, beside a's decode.
        second = sched.schedule()
        assert second is not None
        assert [r.req_pool_idx for r in second.new_reqs] == [sched.reqs["b"].req_pool_idx]
        assert sched.reqs["a"].req_pool_idx in [s.req_pool_idx for s in second.scheduled]
        results.append(worker.execute(second))
    for r in results:
        sched.commit(r)
    outputs, ends = run(sched, worker, depth)
    assert outputs["a"] == expected_output([1, 2, 3], 10)
    assert outputs["b"] == expected_output([4, 5], 3)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("depth", [1, 2])
def test_shared_prefix_is_prefilled_once(page: int, depth: int) -> None:
    rng = random.Random(2)
    system = [rng.randrange(1, VOCAB) for _ in range(200)]
    sched, worker = make(page=page, depth=depth)
    sched.add_request(req("first", system + [5, 6, 7], max_tokens=4))
    run(sched, worker, depth)
    before = sched.stats.prefill_tokens
    sched.add_request(req("second", system + [9, 9, 9, 9], max_tokens=4))
    outputs, _ = run(sched, worker, depth)
    cached = 200 // page * page
    assert sched.stats.prefill_tokens - before == len(system) + 4 - cached
    assert outputs["second"] == expected_output(system + [9, 9, 9, 9], 4)


def test_prefix_cache_off_prefills_everything() -> None:
    system = list(range(1, 90))
    sched, worker = make(cache=False)
    for i in range(2):
        sched.add_request(req(f"r{i}", system + [i + 1], max_tokens=2))
        run(sched, worker, 1)
    assert sched.stats.prefill_tokens == 2 * 90
    assert sched.kv.num_free_slots == sched.kv.allocator.size


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_keeps_decodes_going_every_step(depth: int) -> None:
    sched, worker = make(slots=8192, depth=depth, budget=512, chunk=256, max_len=4096)
    for i in range(16):
        sched.add_request(req(f"d{i}", [i + 1, 2, 3], max_tokens=40))
    for _ in range(4):  # the decoders are running
        so = sched.schedule()
        assert so is not None
        sched.commit(worker.execute(so))
    long_prompt = [(i * 7) % (VOCAB - 1) + 1 for i in range(2000)]
    sched.add_request(req("long", long_prompt, max_tokens=3))
    while sched.reqs.get("long") is not None and len(sched.reqs["long"].output_ids) == 0:
        so = sched.schedule()
        assert so is not None
        rows = {s.req_pool_idx: s.num_tokens for s in so.scheduled}
        decoders = [r for r in sched.running if r.rid.startswith("d") and not r.finished()]
        assert all(rows.get(r.req_pool_idx) == 1 for r in decoders), "a decode skipped a step"
        long_row = sched.reqs["long"].req_pool_idx
        assert rows.get(long_row, 0) <= 256
        sched.commit(worker.execute(so))
        while len(sched.inflight):
            break
    outputs, _ = run(sched, worker, depth)
    assert outputs["long"] == expected_output(long_prompt, 3)
    # Chunks were cached as they went: the whole prompt but the last partial chunk is in the tree.
    assert sched.kv.tree.total_size() >= 2000 - 256


def test_capacity_freed_by_step_n_is_used_from_n_plus_2() -> None:
    sched, worker = make(depth=2, max_running=1)
    sched.add_request(req("a", [1, 2, 3], max_tokens=2))
    sched.add_request(req("b", [4, 5], max_tokens=2))
    n = sched.schedule()  # a's prefill (samples its 1st token)
    n1 = sched.schedule()  # a's decode (its 2nd and last token): no room for b yet
    assert n is not None and n1 is not None and not n1.new_reqs
    sched.commit(worker.execute(n))
    assert sched.schedule() is None  # a is at max_tokens in flight; b still has no row
    sched.commit(worker.execute(n1))  # a finishes: its row is free from the next step on
    n2 = sched.schedule()
    assert n2 is not None and [r.req_pool_idx for r in n2.new_reqs] == [sched.reqs["b"].req_pool_idx]
    assert n2.freed_req_pool_indices  # a's row is dropped before b is added
    sched.commit(worker.execute(n2))
    outputs, _ = run(sched, worker, 2)
    assert outputs["b"] == expected_output([4, 5], 2)


class _FakeGrammar:
    """Duck-typed RequestGrammar: records what it accepted and when its masks were filled."""

    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.filled_after: list[int] = []

    def accept(self, tok: int) -> bool:
        self.accepted.append(tok)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= 4

    def fill_bitmask(self, mask, row: int) -> bool:
        self.filled_after.append(len(self.accepted))
        return True


def test_constrained_step_forwards_early_and_samples_after_the_previous_commit() -> None:
    sched, worker = make(depth=2)
    sched.add_request(req("g", [1, 2, 3], max_tokens=10))
    g = sched.reqs["g"].grammar = _FakeGrammar()
    n = sched.schedule()
    assert n is not None and n.defer_sample
    sched.build_sample(sched.inflight[0])  # N is the oldest: its mask needs nothing more
    n1 = sched.schedule()  # N+1's forward goes out before N's token is back...
    assert n1 is not None and n1.defer_sample
    assert g.filled_after == [0]
    sched.commit(worker.execute(n))  # ...and its mask only after N's token was accepted
    sched.build_sample(sched.inflight[0])
    assert g.filled_after == [0, 1] and len(g.accepted) == 1
    sched.commit(worker.execute(n1))
    while sched.has_work:
        so = sched.schedule()
        assert so is not None
        sched.build_sample(sched.inflight[0])
        sched.commit(worker.execute(so))
    assert len(g.accepted) == 4 and g.filled_after == [0, 1, 2, 3]  # ended by the grammar's termination
    assert sched.kv.tree.protected_size == 0


def test_a_request_is_prefilling_until_only_its_next_token_is_left() -> None:
    """Req.is_prefilling, the one test of it the scheduler asks: prompt tokens left, or more than one token
    of any kind (a retracted request's re-prefill of its outputs)."""
    req = Req("r", [5, 6, 7], SamplingParams(max_tokens=8), frozenset(), 8)
    assert req.is_prefilling  # nothing computed
    req.num_computed_tokens = 2
    assert req.is_prefilling  # a chunk left: one prompt token is still a prompt token
    req.num_computed_tokens = 3
    req.num_output_placeholders = 1  # the prompt's step sampled; its token is in flight
    assert not req.is_prefilling
    req.num_output_placeholders, req.output_ids = 0, [9, 10, 11]
    req.num_computed_tokens = 0  # retracted: it re-prefills prompt and outputs
    assert req.is_prefilling
    req.num_computed_tokens = 5
    assert not req.is_prefilling  # only the newest output's KV is left: a decode

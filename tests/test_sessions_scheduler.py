"""Sessions in the scheduler against the fake worker (whose KV slots record the prefix they were computed
for, so a wrong held prefix shows): turns continue from the held KV with nothing of earlier turns
recomputed, even while other traffic evicts the radix tree; branches; capacity; close and timeout give
the KV back; typed errors; and the integrity check accounting for every lock."""
from __future__ import annotations

import random

import pytest

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode
from tandem.protocol.messages import (
    CloseSession,
    OpenSession,
    RequestError,
    SampleStep,
    SessionParams,
    SessionReply,
    TokenBatch,
    TokenizedRequest,
)
from tandem.protocol.model_info import ModelInfo
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.step_driver import StepDriver
from tests.fake_worker import VOCAB, FakeWorker, expected_output


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(slots: int = 4096, depth: int = 1, page: int = 1, cache: bool = True, cap: int | None = None,
         host: int = 0):
    cfg = EngineConfig(
        model="x",
        max_num_batched_tokens=256,
        max_running_requests=16,
        async_scheduling=depth == 2,
        page_size=page,
        prefix_cache=cache,
        session_kv_tokens=cap,
        host_kv_tokens=host,
    )
    info = ModelInfo(vocab_size=VOCAB, max_model_len=1024, eos_token_ids=[0], architecture="fake")
    sched = Scheduler(cfg, info, slots)
    sched.sessions.clock = Clock()
    return sched, FakeWorker(slots + page - 1), StepDriver(sched, depth)


def drive(sched: Scheduler, worker: FakeWorker, driver: StepDriver) -> tuple[dict, dict]:
    """Run until idle: each request's tokens and how it ended; integrity checked at every step."""
    outputs: dict[str, list[int]] = {}
    ends: dict[str, object] = {}
    queue: list = []
    deferred: dict = {}
    for _ in range(10_000):
        for m in driver.pump():
            if isinstance(m, SampleStep):
                queue.append(deferred.pop(m.step_id))
            else:
                queue.append(worker.execute(m))
        if queue:
            driver.on_result(queue.pop(0))
        sched.check_integrity()
        for msg in driver.take_outbox():
            if isinstance(msg, TokenBatch):
                for d in msg.deltas:
                    outputs.setdefault(d.rid, []).extend(d.token_ids)
                    if d.finish_reason is not None:
                        ends[d.rid] = d.finish_reason
            elif isinstance(msg, RequestError):
                ends[msg.rid] = msg.code
        if not sched.has_work and not sched.inflight and not queue:
            return outputs, ends
    raise AssertionError("not idle after 10000 steps")


def open_session(driver: StepDriver, capacity: int = 2048, timeout: float = 60.0) -> str:
    reply = driver.on_request(OpenSession("o", capacity, timeout))
    assert isinstance(reply, SessionReply) and reply.opened, reply
    return reply.session_id


def turn(rid: str, prompt: list[int], sid: str | None = None, branch: str | None = None, n: int = 6,
         **kw) -> TokenizedRequest:
    sp = SessionParams(sid, branch) if sid is not None else None
    return TokenizedRequest(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kw), 0, sp)


def kv_full(sched: Scheduler) -> bool:
    kv = sched.kv
    return kv.tree.protected_size == 0 and kv.available_slots == kv.allocator.size


def other_traffic(sched, worker, driver, rng: random.Random, tokens: int) -> None:
    """Unrelated prompts that need about `tokens` of KV, one by one: they evict whatever the radix tree
    can give (checked: the first of them is gone from it by the end)."""
    prompts = [[rng.randrange(1, VOCAB) for _ in range(40)] for _ in range(tokens // 44 + 1)]
    for p in prompts:
        sched.add_request(turn(f"x{rng.random()}", p, n=4))
        _, ends = drive(sched, worker, driver)
        assert all(e == "length" for e in ends.values()), ends
    assert len(sched.kv.tree.match_prefix(prompts[0]).indices) < 40, "nothing was evicted"


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("page", [1, 4])
def test_six_turns_through_a_session_equal_the_whole_turns_with_no_earlier_turn_recomputed(
    depth, page
) -> None:
    rng = random.Random(depth * 10 + page)
    sched, worker, driver = make(slots=512, depth=depth, page=page, cap=256)
    sid = open_session(driver, capacity=256)
    context: list[int] = []
    for k in range(6):
        new = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 12))]
        sched.add_request(turn(f"t{k}", new, sid))
        req = sched.reqs[f"t{k}"]
        before = sched.stats.prefill_tokens
        outputs, ends = drive(sched, worker, driver)
        assert outputs[f"t{k}"] == expected_output(context + new, 6), f"turn {k}"
        assert ends[f"t{k}"] == "length"
        if k:
            # Only the previous turn's last token (sampled, never fed) and the new prompt; the rest is the
            # session's, up to the page it ends in.
            held = (len(context) - 1) // page * page
            assert req.prefix_source == "session" and req.cached_tokens == held, (k, req.cached_tokens)
            assert sched.stats.prefill_tokens - before == len(context) + len(new) - held
        context = context + new + outputs[f"t{k}"]
        assert sched.kv.tree.protected_size == sched.sessions.held_tokens() > 0
        other_traffic(sched, worker, driver, rng, 700)  # more than the pool: all unlocked cache goes
    sched.check_integrity()
    assert sched.sessions.on_close(CloseSession("c", sid)) == SessionReply("c", sid, False)
    assert kv_full(sched) and sched.sessions.held_tokens() == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_with_a_host_tier_the_turns_are_held_there_and_loaded_back(depth: int) -> None:
    """The session pins nothing on the device: other traffic evicts its turns' device copies, and each
    continuation loads its history back from the host tier (the fake worker checks the copies' contents)."""
    rng = random.Random(3)
    sched, worker, driver = make(slots=320, depth=depth, cap=150, host=2048)
    sid = open_session(driver, capacity=150)
    context: list[int] = []
    for k in range(5):
        new = [rng.randrange(1, VOCAB) for _ in range(10)]
        sched.add_request(turn(f"t{k}", new, sid))
        req = sched.reqs[f"t{k}"]
        before, loaded = sched.stats.prefill_tokens, sched.kv.host_hit_tokens
        outputs, _ = drive(sched, worker, driver)
        assert outputs[f"t{k}"] == expected_output(context + new, 6), f"turn {k}"
        if k:
            assert req.prefix_source == "session" and sched.stats.prefill_tokens - before == 1 + len(new)
            assert sched.kv.host_hit_tokens - loaded == len(context) - 1  # all of it evicted, all loaded back
        context = context + new + outputs[f"t{k}"]
        assert all(h.host for h in sched.sessions.holds()) and sched.kv.tree.protected_size == 0
        other_traffic(sched, worker, driver, rng, 700)
    assert worker.copied_to_device > 0
    sched.sessions.on_close(CloseSession("c", sid))
    assert kv_full(sched) and not any(n.host_lock_ref for n in sched.kv.tree.nodes())
    # A host pool too small for a turn: it is pinned on the device instead.
    sched, worker, driver = make(slots=320, cap=150, host=16)
    sid = open_session(driver, capacity=150)
    sched.add_request(turn("a", list(range(1, 40)), sid))
    drive(sched, worker, driver)
    assert [h.host for h in sched.sessions.holds()] == [False] and sched.kv.tree.protected_size == 44
    sched.sessions.on_close(CloseSession("c", sid))
    assert kv_full(sched)


def test_a_branch_from_turn_three_equals_resending_turns_one_to_three() -> None:
    rng = random.Random(5)
    sched, worker, driver = make(slots=600)
    sid = open_session(driver, capacity=300)
    contexts = []
    context: list[int] = []
    for k in range(5):
        new = [rng.randrange(1, VOCAB) for _ in range(8)]
        sched.add_request(turn(f"t{k}", new, sid))
        outputs, _ = drive(sched, worker, driver)
        context = context + new + outputs[f"t{k}"]
        contexts.append(context)
        other_traffic(sched, worker, driver, rng, 700)
    new = [7, 8, 9]
    before = sched.stats.prefill_tokens
    sched.add_request(turn("branch", new, sid, branch="t2"))
    req = sched.reqs["branch"]
    outputs, _ = drive(sched, worker, driver)
    assert outputs["branch"] == expected_output(contexts[2] + new, 6)
    assert req.prefix_source == "session" and sched.stats.prefill_tokens - before == 1 + len(new)
    # The branch is the latest turn now: a continuation without a rid follows it.
    sched.add_request(turn("after", [4], sid))
    outputs2, _ = drive(sched, worker, driver)
    assert outputs2["after"] == expected_output(contexts[2] + new + outputs["branch"] + [4], 6)
    sched.sessions.on_close(CloseSession("c", sid))
    assert kv_full(sched)


def test_capacity_lets_go_of_the_oldest_turns_and_a_continuation_of_one_still_matches() -> None:
    sched, worker, driver = make(slots=400)
    sid = open_session(driver, capacity=40)
    sched.add_request(turn("a", list(range(1, 21)), sid, n=5))  # 25 tokens of context
    drive(sched, worker, driver)
    sched.add_request(turn("b", list(range(50, 60)), sid, branch="a", n=5))
    drive(sched, worker, driver)
    sched.add_request(turn("c", list(range(60, 70)), sid, branch="a", n=5))  # held: 24 + 15 + 15 > 40
    drive(sched, worker, driver)
    s = sched.sessions.sessions[sid]
    assert sched.sessions.held_tokens() == 39  # c alone: the oldest went first, a (which c covers) and b
    assert s.turns["c"].hold is not None and s.turns["a"].hold is None and s.turns["b"].hold is None
    ctx_a = list(range(1, 21)) + expected_output(list(range(1, 21)), 5)
    sched.add_request(turn("from-a", [9], sid, branch="a", n=3))  # let go: a plain radix match serves it
    out2, _ = drive(sched, worker, driver)
    assert out2["from-a"] == expected_output(ctx_a + [9], 3)
    # A prompt past the capacity is refused; a turn longer than it is held only up to it.
    sched.add_request(turn("big", list(range(1, 60)), sid))
    _, ends = drive(sched, worker, driver)
    assert ends["big"] == ErrorCode.SESSION_CAPACITY
    sched.add_request(turn("long", [3], sid, branch="from-a", n=30))  # 30 tokens of prompt, 59 of context
    drive(sched, worker, driver)
    assert sched.sessions.held_tokens() == 40 and s.turns["long"].hold is not None
    sched.sessions.on_close(CloseSession("c", sid))
    assert kv_full(sched)


def test_timeout_closes_an_idle_session_never_a_running_one() -> None:
    sched, worker, driver = make()
    sid = open_session(driver, timeout=5.0)
    clock = sched.sessions.clock
    sched.add_request(turn("a", [1, 2, 3], sid, n=40))
    steps = driver.pump()
    clock.t += 100  # its request runs: no timeout
    assert sched.sessions.next_deadline() is None and sched.sessions.expire() == []
    for m in steps:
        driver.on_result(worker.execute(m))
    drive(sched, worker, driver)
    assert sched.kv.tree.protected_size > 0
    assert 4000 < driver.poll_timeout_ms() <= 5000  # idle: it wakes up for the deadline
    clock.t += 5.0
    driver.pump()
    assert sid not in sched.sessions.sessions and kv_full(sched)
    sched.add_request(turn("late", [4], sid))
    _, ends = drive(sched, worker, driver)
    assert ends["late"] == ErrorCode.SESSION_CLOSED


def test_bad_session_calls_are_typed_errors_and_the_scheduler_serves_on() -> None:
    sched, worker, driver = make(cap=100)
    sid = open_session(driver, capacity=60)

    def err(reply) -> str:
        assert isinstance(reply, RequestError), reply
        return reply.code

    assert err(driver.on_request(OpenSession("o", 41, 10))) == ErrorCode.SESSION_CAPACITY  # 60 + 41 > 100
    assert err(driver.on_request(OpenSession("o", 0, 10))) == ErrorCode.SESSION
    assert err(driver.on_request(OpenSession("o", 10, float("nan")))) == ErrorCode.SESSION
    assert err(driver.on_request(OpenSession("o", 10, -1))) == ErrorCode.SESSION
    assert err(driver.on_request(CloseSession("c", "nope"))) == ErrorCode.SESSION_UNKNOWN
    sched.add_request(turn("u", [1], "nope"))
    sched.add_request(turn("t", [1], sid, branch="no-such-turn"))
    sched.add_request(turn("fine", [1, 2], sid))
    sched.add_request(turn("plain", [1, 2]))
    outputs, ends = drive(sched, worker, driver)
    assert ends == {"u": ErrorCode.SESSION_UNKNOWN, "t": ErrorCode.SESSION_TURN, "fine": "length",
                    "plain": "length"}
    assert outputs["fine"] == outputs["plain"] == expected_output([1, 2], 6)
    assert isinstance(driver.on_request(CloseSession("c", sid)), SessionReply)
    assert err(driver.on_request(CloseSession("c", sid))) == ErrorCode.SESSION_CLOSED
    for cache, cap in ((False, None), (True, 0)):
        s2, _, d2 = make(cache=cache, cap=cap)
        assert err(d2.on_request(OpenSession("o", 10, 10))) == ErrorCode.SESSION
    with pytest.raises(ValueError, match="session_kv_tokens"):
        make(slots=64, cap=64)


def test_an_aborted_or_failed_turn_is_not_held_and_the_session_serves_on() -> None:
    sched, worker, driver = make()
    sid = open_session(driver)
    sched.add_request(turn("a", [1, 2, 3], sid, n=50))
    for m in driver.pump():
        driver.on_result(worker.execute(m))
    sched.abort("a")
    drive(sched, worker, driver)
    s = sched.sessions.sessions[sid]
    assert s.turns == {} and s.active == 0 and sched.kv.tree.protected_size == 0
    sched.add_request(turn("b", [1, 2, 3], sid))
    out, _ = drive(sched, worker, driver)
    assert out["b"] == expected_output([1, 2, 3], 6) and list(s.turns) == ["b"]


def test_integrity_accounts_for_every_lock() -> None:
    sched, worker, driver = make()
    sid = open_session(driver)
    sched.add_request(turn("a", list(range(1, 30)), sid))
    drive(sched, worker, driver)
    sched.check_integrity()
    with pytest.raises(AssertionError, match="lock_ref"):
        sched.kv.check_integrity([], [])  # the session's lock, unaccounted
    node = sched.sessions.sessions[sid].turns["a"].hold.node
    sched.kv.tree.inc_lock_ref(node)  # a leaked lock
    with pytest.raises(AssertionError, match="lock_ref"):
        sched.check_integrity()
    sched.kv.tree.dec_lock_ref(node)
    sched.kv.check_idle(sched.sessions.holds())
    with pytest.raises(AssertionError, match="idle KV"):
        sched.kv.check_idle([])  # locked, but not by a session
    sched.sessions.on_close(CloseSession("c", sid))
    sched.check_integrity()
    sched.kv.check_idle([])
    assert kv_full(sched)

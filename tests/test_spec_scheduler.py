"""Speculative decoding in the scheduler against the fake worker: counters and KV at every step for
acceptance of none, some and all of K drafts, synchronous and with a step in flight; outputs equal to
speculation off under stop tokens, max_tokens, aborts and KV pressure."""
from __future__ import annotations

import random

import pytest

from tandem.scheduler import spec_decode
from tandem.scheduler.req import Req
from tandem.scheduler.scheduler import Scheduler
from tests.fake_worker import VOCAB, expected_output, true_drafts
from tests.test_scheduler_core import abort_long_at, make, req, run

K = 4


def wrong_drafts(tokens: list[int], k: int) -> list[int]:
    return [(t + 1) % VOCAB for t in true_drafts(tokens, k)]


def first_right(m: int):
    def drafter(tokens: list[int], k: int) -> list[int]:
        return true_drafts(tokens, k)[:m] + wrong_drafts(tokens, k)[m:]

    return drafter


def check_counters(sched: Scheduler, r: Req) -> None:
    """What a request's counters must say, from the steps in flight alone."""
    in_flight = [
        (s, s.reqs.index(r)) for s in sched.inflight if r in s.reqs and s.epochs[s.reqs.index(r)] == r.epoch
    ]
    assert r.num_inflight_steps == len(in_flight)
    tokens = sum(s.num_tokens[i] for s, i in in_flight)
    assert r.kv_committed_len == r.num_computed_tokens - tokens
    assert r.num_output_placeholders == sum(1 + s.num_drafts[i] for s, i in in_flight if i in s.samplers)
    assert r.kv_allocated_len == r.num_computed_tokens  # page 1: no KV left over from rejected drafts
    if len(r.output_ids) and not r.finished():
        assert r.num_tokens_to_compute == 1  # decoding: exactly the last sampled token is uncomputed


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("right", [0, 1, 3, K])
def test_counters_and_kv_at_every_step(depth: int, right: int) -> None:
    sched, worker = make(depth=depth, spec=K, drafter=first_right(right))
    prompt = [5, 6, 7, 8, 9]
    sched.add_request(req("a", prompt, max_tokens=40))
    steps_seen: list[int] = []

    def on_step(step: int) -> None:  # after scheduling, before the oldest step is committed
        r = sched.reqs.get("a")
        if r is not None:
            check_counters(sched, r)
            steps_seen.append(len(sched.inflight))

    outputs, ends = run(sched, worker, depth, on_step)
    assert outputs["a"] == expected_output(prompt, 40)
    assert ends["a"] == ("length", None)
    spec = sched.spec
    assert spec.draft_tokens > 0
    # Every verify step accepts min(right, D) drafts: totals and per position follow.
    verify = [s for so in worker.steps for s in so.scheduled if s.num_drafts]
    assert spec.accepted_tokens == sum(min(right, s.num_drafts) for s in verify)
    assert spec.accepted_at[:right] == [sum(s.num_drafts > j for s in verify) for j in range(right)]
    assert sum(spec.accepted_at[right:]) == 0
    if right == K:
        # All accepted: 1 + K outputs per decode step (the prefill gives the first output).
        assert len(worker.steps) <= 1 + -(-39 // (K + 1)) + 1
    if depth == 2:
        assert max(steps_seen) == 2  # a step really was in flight while the next was formed


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 7, 11])
def test_max_tokens_inside_an_accepted_run(depth: int, max_tokens: int) -> None:
    sched, worker = make(depth=depth, spec=K)
    prompt = [3, 1, 4, 1, 5]
    sched.add_request(req("a", prompt, max_tokens=max_tokens))
    outputs, ends = run(sched, worker, depth)
    assert outputs["a"] == expected_output(prompt, max_tokens)
    assert ends["a"] == ("length", None)
    # Drafts never reach past max_tokens: nothing is computed beyond the last output's predecessor.
    computed = sum(s.num_tokens for so in worker.steps for s in so.scheduled)
    assert computed <= len(prompt) + max_tokens - 1 + (depth - 1) * (K + 1)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("at", [1, 2, 3, 6])
def test_stop_token_inside_an_accepted_run_drops_the_rest(depth: int, at: int) -> None:
    prompt = [11, 12, 13]
    want = expected_output(prompt, 40)
    stop = want[at]
    assert stop not in want[:at]
    sched, worker = make(depth=depth, spec=K)
    sched.add_request(req("a", prompt, max_tokens=40, stop_token_ids=[stop]))
    sched.add_request(req("b", [20, 21], max_tokens=9))
    outputs, ends = run(sched, worker, depth)
    assert outputs["a"] == want[: at + 1]
    assert ends["a"] == ("stop", stop)
    assert outputs["b"] == expected_output([20, 21], 9)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("abort_at", [0, 1, 2, 4, 7])
@pytest.mark.parametrize("right", [0, 2, K])
def test_abort_in_flight(depth: int, abort_at: int, right: int) -> None:
    sched, worker = make(depth=depth, budget=16, spec=K, drafter=first_right(right))
    abort_long_at(sched, worker, depth, abort_at)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("right", [1, K])
def test_kv_pressure_with_retraction_equals_off(depth: int, page: int, right: int) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(40)]
    want = {f"r{i}": expected_output(p, 40) for i, p in enumerate(prompts)}
    need = sum(len(p) + 40 for p in prompts)
    sched, worker = make(slots=max(need // 12, 16 * page), depth=depth, budget=128, page=page, spec=K,
                         drafter=first_right(right))
    for i, p in enumerate(prompts):
        sched.add_request(req(f"r{i}", p, max_tokens=40))
    outputs, ends = run(sched, worker, depth)
    assert outputs == want
    assert sched.stats.retractions > 0
    assert sched.spec.accepted_tokens > 0
    assert all(e == ("length", None) for e in ends.values())


@pytest.mark.parametrize("depth", [1, 2])
def test_ineligible_requests_get_no_drafts(depth: int) -> None:
    sched, worker = make(depth=depth, spec=K)
    sched.add_request(req("pen", [1, 2, 3], max_tokens=6, repetition_penalty=1.2))
    sched.add_request(req("lp", [1, 2, 4], max_tokens=6, logprobs=2))
    sched.add_request(req("mt", [1, 2, 5], max_tokens=6, min_tokens=3))
    outputs, _ = run(sched, worker, depth)
    owner: dict[int, int] = {}  # row -> the last prompt token, which names the request
    drafted = set()
    for so in worker.steps:
        owner.update({n.req_pool_idx: n.token_ids[2] for n in so.new_reqs})
        drafted |= {owner[s.req_pool_idx] for s in so.scheduled if s.num_drafts}
    # min_tokens only holds drafts back until it is reached: its last outputs may be speculated.
    assert drafted <= {5}, f"rows drafted for prompts ending {sorted(drafted)}: only min_tokens' may"
    assert outputs["pen"] == expected_output([1, 2, 3], 6) and outputs["lp"] == expected_output([1, 2, 4], 6)
    assert outputs["mt"] == expected_output([1, 2, 5], 6)


def matches_when(pred):
    """A drafter that proposes the true continuation where pred(tokens) holds and nothing (no match)
    elsewhere, as the CPU worker's proposer does for a row whose n-grams never recur."""
    def drafter(tokens: list[int], k: int) -> list[int]:
        return true_drafts(tokens, k) if pred(tokens) else []

    return drafter


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("every", [1, 2, 3])
def test_no_match_rows_run_as_plain_decodes(depth: int, every: int) -> None:
    """Rows without a match verify nothing: the worker computes one token, the scheduler rolls the
    scheduled drafts back like rejected ones (counters, placeholders and KV at every step), and the
    draft totals count only what was verified. every=1: a row that never matches."""
    sched, worker = make(
        depth=depth, spec=K, drafter=matches_when(lambda t: every > 1 and len(t) % every == 0)
    )
    prompt = [5, 6, 7, 8, 9]
    sched.add_request(req("a", prompt, max_tokens=30))

    def on_step(step: int) -> None:
        r = sched.reqs.get("a")
        if r is not None:
            check_counters(sched, r)

    outputs, ends = run(sched, worker, depth, on_step)
    assert outputs["a"] == expected_output(prompt, 30)
    assert ends["a"] == ("length", None)
    scheduled = sum(s.num_drafts for so in worker.steps for s in so.scheduled)
    assert scheduled > 0
    spec = sched.spec
    if every == 1:
        assert spec.draft_tokens == spec.accepted_tokens == spec.num_drafts == 0
    else:
        # Each matched draft is right (true continuation): every verified draft is accepted.
        assert 0 < spec.draft_tokens == spec.accepted_tokens < scheduled


@pytest.mark.parametrize("depth", [1, 2])
def test_matched_and_unmatched_rows_in_one_step(depth: int) -> None:
    """One row always matches, one never: outputs equal speculation off, and the unmatched row's
    counters and KV are right at every step with the other's drafts verified beside it."""
    prompts = {"m": [1, 2, 3, 4], "n": [40, 41, 42]}
    sched, worker = make(depth=depth, spec=K, drafter=matches_when(lambda t: t[0] == 1))
    for rid, p in prompts.items():
        sched.add_request(req(rid, p, max_tokens=25))

    def on_step(step: int) -> None:
        for r in list(sched.reqs.values()):
            check_counters(sched, r)

    outputs, _ = run(sched, worker, depth, on_step)
    assert outputs == {rid: expected_output(p, 25) for rid, p in prompts.items()}
    both = [so for so in worker.steps if len([s for s in so.scheduled if s.num_drafts]) == 2]
    assert both, "the two rows never had drafts scheduled in one step"
    assert sched.spec.accepted_tokens == sched.spec.draft_tokens > 0


@pytest.mark.parametrize("depth", [1, 2])
def test_speculation_off_never_enters_spec_decode(depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a speculative method the scheduler holds no Speculation, and no step calls into
    spec_decode: every entry point there raises, and a run of plain decodes still gives its outputs."""
    def entered(*args: object, **kwargs: object) -> None:
        raise AssertionError("spec_decode entered with speculation off")

    for name in ("num_drafts", "commit"):
        monkeypatch.setattr(spec_decode.Speculation, name, entered)
    monkeypatch.setattr(spec_decode.SpecStats, "record", entered)
    monkeypatch.setattr(spec_decode, "rollback", entered)
    sched, worker = make(depth=depth)
    assert sched.speculation is None
    prompts = {"a": [5, 6, 7, 8], "b": [9, 9, 2]}
    for rid, p in prompts.items():
        sched.add_request(req(rid, p, max_tokens=12))
    outputs, _ = run(sched, worker, depth)
    assert outputs == {rid: expected_output(p, 12) for rid, p in prompts.items()}
    assert sched.spec.draft_tokens == sched.load.spec_draft_tokens == 0

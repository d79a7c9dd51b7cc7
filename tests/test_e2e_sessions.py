"""Sessions and priorities through the whole stack, a served tiny model (float32) with a small KV pool: over
ZMQ (the Python client) and HTTP (the official openai client and plain POSTs)."""
from __future__ import annotations

import asyncio
import random
import time

import httpx2 as httpx
import openai
import pytest

from tandem import AsyncClient, Client
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.messages import SessionParams
from tests.conftest import check_idle_engine
from tests.reference import assert_equal_or_near_tie
from tests.served import Served

GREEDY = {"temperature": 0.0, "ignore_eos": True}
POOL = 640


@pytest.fixture(scope="module")
def served(tiny_model):
    s = Served(tiny_model("llama"), "--kv-cache-tokens", str(POOL), "--session-kv-tokens", "320",
               "--max-running-requests", "1", "--scheduling-policy", "priority", "--debug-integrity",
               "--served-model-name", "m").ready()
    yield s
    assert s.close() == 0


@pytest.fixture(scope="module")
def engine(served):
    c = Client(served.endpoint)
    yield c
    c.close()


def _evict_everything(engine: Client, rng: random.Random) -> None:
    """Unrelated traffic needing more KV than the pool: every unlocked node of the radix tree goes."""
    prompts = [[rng.randrange(3, 1000) for _ in range(60)] for _ in range(POOL // 64 + 2)]
    engine.generate_batch(prompts, {"max_tokens": 4, **GREEDY}, progress=False)
    again = engine.generate(prompts[0], {"max_tokens": 1, **GREEDY})
    assert again.cached_tokens < 60, "the other traffic should have evicted the first of it"


def test_six_turns_and_a_branch_through_a_session_equal_the_turns_sent_whole(
    engine, tiny_model, launch_client
):
    model = tiny_model("llama")
    rng = random.Random(11)
    turns: list[tuple[list[int], list[int]]] = []  # (whole prompt, output) of each turn
    rids: list[str] = []
    context: list[int] = []
    with engine.open_session(capacity_tokens=300, timeout_s=120) as session:
        for k in range(6):
            new = [rng.randrange(3, 1000) for _ in range(10)]
            before = engine.stats().prefill_tokens
            c = session.generate(new, {"max_tokens": 8, **GREEDY})
            computed = engine.stats().prefill_tokens - before
            # nothing of earlier turns computed again: the last output token (never fed) and the new ones
            if k:
                assert computed == 1 + len(new), (k, computed)
                assert c.prefix_source == "session" and c.cached_tokens == len(context) - 1
            assert c.prompt_tokens == len(context) + len(new)
            turns.append((context + new, c.token_ids))
            rids.append(c.request_id)
            context = context + new + c.token_ids
            _evict_everything(engine, rng)
        assert engine.stats().session_held_tokens == len(context) - 1
        branch_new = [5, 6, 7, 8]
        before = engine.stats().prefill_tokens
        b = session.generate(branch_new, {"max_tokens": 8, **GREEDY}, branch_from=rids[2])
        assert engine.stats().prefill_tokens - before == 1 + len(branch_new)
        turns.append((turns[2][0] + turns[2][1] + branch_new, b.token_ids))
    st = engine.stats()
    assert st.sessions_open == 0 and st.session_held_tokens == 0
    check_idle_engine(engine)  # closed: nothing locked, KV back to full

    whole = launch_client(model, prefix_cache=False)  # every turn computed from scratch
    want = whole.generate_batch([p for p, _ in turns], {"max_tokens": 8, **GREEDY}, progress=False)
    for k, ((prompt, got), w) in enumerate(zip(turns, want)):
        assert_equal_or_near_tie(model, prompt, got, w.token_ids, f"turn {k}")


def test_timeout_gives_the_kv_back(engine) -> None:
    session = engine.open_session(capacity_tokens=100, timeout_s=1.0)
    session.generate([7, 8, 9, 10], {"max_tokens": 4, **GREEDY})
    assert engine.stats().session_held_tokens > 0
    # The scheduler wakes up for the deadline by itself: polled, not a sleep raced against the timeout.
    give_up = time.monotonic() + 30
    while engine.stats().sessions_open and time.monotonic() < give_up:
        time.sleep(0.05)
    st = engine.stats()
    assert st.sessions_open == 0 and st.session_held_tokens == 0 and st.kv_cache_locked == 0
    with pytest.raises(InvalidRequestError) as e:
        session.generate([1], {"max_tokens": 2})
    assert e.value.code == ErrorCode.SESSION_CLOSED
    check_idle_engine(engine)


def test_bad_session_ids_and_caps_over_zmq_are_typed_errors_and_the_engine_serves_on(engine) -> None:
    cases = [
        (
            lambda: engine.generate([1, 2], {"max_tokens": 2}, session=SessionParams("nope")),
            ErrorCode.SESSION_UNKNOWN,
        ),
        (lambda: engine.close_session("nope"), ErrorCode.SESSION_UNKNOWN),
        (lambda: engine.open_session(capacity_tokens=10_000), ErrorCode.SESSION_CAPACITY),
        (lambda: engine.open_session(capacity_tokens=0), ErrorCode.SESSION),
    ]
    s = engine.open_session(capacity_tokens=50)
    cases += [(lambda: s.generate([1], {"max_tokens": 2}, branch_from="no-turn"), ErrorCode.SESSION_TURN),
              (lambda: s.generate(list(range(3, 60)), {"max_tokens": 2}), ErrorCode.SESSION_CAPACITY)]
    for call, code in cases:
        with pytest.raises(InvalidRequestError) as e:
            call()
        assert e.value.code == code, (code, e.value)
    s.close()
    with pytest.raises(InvalidRequestError) as e:
        s.close()
    assert e.value.code == ErrorCode.SESSION_CLOSED
    assert len(engine.generate([1, 2, 3], {"max_tokens": 3, **GREEDY}).token_ids) == 3
    check_idle_engine(engine)


def test_sessions_and_priority_over_http(served, engine) -> None:
    url = served.url
    oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    sid = httpx.post(url + "/open_session", json={"capacity_tokens": 200, "timeout": 60}).json()
    assert isinstance(sid, str) and sid
    p1, p2 = [11, 12, 13, 14, 15], [21, 22, 23]
    r1 = oai.completions.create(model="m", prompt=p1, max_tokens=6, temperature=0,
                                extra_body={"session_params": {"id": sid}, "ignore_eos": True})
    r2 = oai.completions.create(model="m", prompt=p2, max_tokens=6, temperature=0,
                                extra_body={"session_params": {"id": sid, "rid": r1.id}, "ignore_eos": True,
                                            "priority": -2})
    out1 = engine.generate(p1, {"max_tokens": 6, **GREEDY})
    ref = engine.generate(p1 + out1.token_ids + p2, {"max_tokens": 6, **GREEDY})
    assert r1.choices[0].text == out1.text and r2.choices[0].text == ref.text
    assert r2.usage.prompt_tokens == len(p1) + 6 + len(p2)
    chat = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       extra_body={"session_params": {"id": sid}, "priority": 4})
    assert chat.usage.prompt_tokens > r2.usage.prompt_tokens  # it continued the latest turn
    assert httpx.post(url + "/close_session", json={"session_id": sid}).json() == {
        "session_id": sid,
        "closed": True,
    }

    def bad(path: str, body: dict, code: str | None, param: str | None = None) -> None:
        r = httpx.post(url + path, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["message"], (
            path,
            r.text,
        )
        if code is not None:
            assert err["code"] == code, (path, err)
        if param is not None:
            assert err["param"] == param, (path, err)

    comp = {"model": "m", "prompt": [1, 2], "max_tokens": 2}
    bad("/v1/completions", {**comp, "session_params": {"id": sid}}, ErrorCode.SESSION_CLOSED)
    bad("/v1/completions", {**comp, "session_params": {"id": "nope"}}, ErrorCode.SESSION_UNKNOWN)
    bad("/v1/completions", {**comp, "n": 2, "session_params": {"id": "nope"}}, None, "session_params")
    bad("/v1/completions", {**comp, "session_params": {"rid": "x"}}, None, "session_params.id")
    bad("/v1/completions", {**comp, "priority": "high"}, None, "priority")
    bad("/close_session", {"session_id": sid}, ErrorCode.SESSION_CLOSED)
    bad("/open_session", {"capacity_tokens": 0}, None, "capacity_tokens")
    bad("/open_session", {"capacity_tokens": 10**6}, ErrorCode.SESSION_CAPACITY)
    assert oai.completions.create(model="m", prompt="still serving", max_tokens=2).choices[0].text is not None
    check_idle_engine(engine)


def test_a_high_priority_request_overtakes_the_queue(served) -> None:
    """One request runs at a time (--max-running-requests 1): of those queued behind it, the highest
    priority (lowest number) goes first, then the rest in arrival order."""
    async def main() -> list[str]:
        async with AsyncClient(served.endpoint) as c:
            done: list[str] = []

            async def one(rid: str, priority: int, n: int) -> None:
                await c.generate([3, 4, 5], {"max_tokens": n, **GREEDY}, rid, priority=priority)
                done.append(rid)

            # As long as the pool left beside the sessions' share allows: the queue forms behind it.
            first = asyncio.ensure_future(one("running", 0, 300))
            while (await c.stats()).running < 1:
                await asyncio.sleep(0.01)
            rest = []
            for rid, prio in (("low-a", 5), ("low-b", 5), ("mid", 1), ("high", -3)):
                rest.append(asyncio.ensure_future(one(rid, prio, 2)))
                while (await c.stats()).waiting < len(rest):  # queued in this order
                    # a machine too slow to queue four requests during 300 decode steps: said, not hung
                    assert not first.done(), f"the first request ended before {rid} was queued"
                    await asyncio.sleep(0.01)
            await asyncio.gather(first, *rest)
            return done

    assert asyncio.run(main()) == ["running", "high", "mid", "low-a", "low-b"]

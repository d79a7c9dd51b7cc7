"""Nothing runs for nobody, and one Client serves any number of threads: a call that stops listening
aborts its requests, only the submitter may abort, and 32 threads sharing a Client get the outputs of a
single-threaded run."""
from __future__ import annotations

import asyncio
import gc
import threading
import time

import msgspec
import pytest
import zmq

from tandem import AsyncClient, Client, EngineDeadError, InvalidRequestError, SamplingParams
from tandem.frontend.client.request_encoding import build_request
from tandem.protocol.codec import encode
from tests.conftest import check_idle_engine
from tests.reference import assert_equal_or_near_tie
from tests.test_e2e_scheduling import GREEDY

LONG = SamplingParams(max_tokens=2000, **GREEDY)
MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def engine(tiny_model, request):
    model = tiny_model("llama")
    c = Client.launch(
        str(model),
        dtype="float32",
        kv_cache_tokens=16384,
        max_running_requests=64,
        debug_integrity=True,
        max_request_bytes=MAX_REQUEST_BYTES,
    )
    request.addfinalizer(c.close)
    return model, c


def _wait_idle(client: Client) -> None:
    """Until nothing runs (bounded so a leak fails, not hangs)."""
    deadline = time.monotonic() + 60
    st = client.stats()
    while st.running or st.waiting:
        assert time.monotonic() < deadline, f"requests still running for nobody: {st}"
        time.sleep(0.02)
        st = client.stats()


def _assert_aborted_early(client: Client, before, n: int = 1) -> None:
    """The n abandoned requests ended `abort`, each far short of its max_tokens: counted in tokens the
    engine decoded, not in time or steps (how many steps an abort takes to arrive is the machine's)."""
    _wait_idle(client)
    st = client.stats()
    assert st.requests_aborted - before.requests_aborted == n
    assert st.decode_tokens - before.decode_tokens < n * LONG.max_tokens // 2, (
        "the abandoned request kept decoding"
    )
    check_idle_engine(client)


@pytest.mark.parametrize("how", ["break", "exception", "garbage"])
def test_leaving_a_stream_early_aborts_it(engine, how: str) -> None:
    _, c = engine
    before = c.stats()
    stream = c.stream([5, 6, 7], LONG)
    got = 0
    try:
        for _ in stream:
            got += 1
            if got == 3:
                if how == "exception":
                    raise KeyError("the caller's own bug")
                break
    except KeyError:
        pass
    if how == "garbage":
        del stream
        gc.collect()
    else:
        stream.close()
    _assert_aborted_early(c, before)


def test_cancelled_async_call_and_left_async_stream_abort(engine) -> None:
    _, c = engine
    before = c.stats()

    async def go() -> None:
        async with AsyncClient(c.endpoint) as ac:
            task = asyncio.ensure_future(ac.generate([9, 8, 7], LONG))
            while (await ac.stats()).running == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stream = ac.stream([9, 8, 6], LONG)
            async for _ in stream:
                break
            await stream.aclose()

    asyncio.run(go())
    _assert_aborted_early(c, before, n=2)


def test_an_error_in_generate_batch_aborts_the_rest(engine) -> None:
    _, c = engine
    # the last: outside the vocabulary
    prompts: list[list[int]] = [[3, 4, 5 + i] for i in range(6)] + [[10**9]]
    before = c.stats()
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        c.generate_batch(prompts, LONG, progress=False)
    _assert_aborted_early(c, before, n=6)

    async def go() -> None:
        async with AsyncClient(c.endpoint) as ac:
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                await ac.generate_batch(prompts, LONG, progress=False)

    before = c.stats()
    asyncio.run(go())
    _wait_idle(c)
    assert c.stats().requests_aborted - before.requests_aborted <= 6  # some may not have been admitted yet
    assert c.stats().decode_tokens - before.decode_tokens < 6 * LONG.max_tokens // 2
    check_idle_engine(c)


def test_only_the_submitter_may_abort(engine) -> None:
    _, c = engine
    with Client(c.endpoint) as other:
        stream = c.stream([1, 2, 3], SamplingParams(max_tokens=40, **GREEDY), request_id="mine")
        first = next(stream)
        other.abort("mine")
        rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 40
    check_idle_engine(c)


def test_a_vanished_client_has_its_requests_aborted(engine) -> None:
    _, c = engine
    before = c.stats()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(c.endpoint)
    sock.send(encode(build_request([4, 4, 4], LONG, "vanishing")))
    assert sock.poll(30_000), "no first output"
    sock.close(0)  # gone without a word: the frontend notices on its next send to it
    ctx.term()
    _assert_aborted_early(c, before)


def test_oversized_request_gets_a_typed_error_and_the_engine_serves_on(engine) -> None:
    _, c = engine
    with pytest.raises(InvalidRequestError) as e:
        c.generate("word " * (MAX_REQUEST_BYTES // 4), SamplingParams(max_tokens=2))
    assert e.value.code == "invalid_request.too_large"
    assert c.generate([1, 2], SamplingParams(max_tokens=3, **GREEDY)).completion_tokens == 3
    check_idle_engine(c)


def test_closed_client_fails_calls_with_a_typed_error(engine) -> None:
    _, c = engine
    other = Client(c.endpoint)
    other.close()
    with pytest.raises(EngineDeadError, match="closed"):
        other.generate([1, 2], SamplingParams(max_tokens=2))


def test_32_threads_share_one_client(engine) -> None:
    model, c = engine
    prompts = [[(7 * i + j) % 900 + 3 for j in range(4 + i % 9)] for i in range(32)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    want = [c.generate(p, params).token_ids for p in prompts]  # the single-threaded run
    errors: list[BaseException] = []
    results: dict[tuple[int, int], list[int]] = {}

    def work(rnd: int, i: int) -> None:
        try:
            kind = (i + rnd) % 4
            if kind == 0:
                results[rnd, i] = c.generate(prompts[i], params).token_ids
            elif kind == 1:
                results[rnd, i] = [t for d in c.stream(prompts[i], params) for t in d.token_ids]
            elif kind == 2:
                rid = f"t{rnd}-{i}"
                deltas = c.stream(prompts[i], LONG, request_id=rid)
                head = next(deltas)
                c.abort(rid)
                rest = list(deltas)
                ends = [d for d in [head, *rest] if d.finished]
                assert len(ends) == 1 and ends[0].finish_reason == "abort", ends
            else:
                st = c.stats()
                assert st.integrity == "ok", st.integrity
                results[rnd, i] = c.generate(prompts[i], params).token_ids
        except BaseException as e:  # the main thread reports it
            errors.append(e)

    for rnd in range(3):
        threads = [threading.Thread(target=work, args=(rnd, i), daemon=True) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a thread hung on the shared client"
        assert not errors, errors
    for (_, i), got in results.items():
        assert_equal_or_near_tie(model, prompts[i], got, want[i])
    assert len(results) == 3 * 24
    check_idle_engine(c)


def test_params_of_the_wrong_shape_are_a_typed_error_for_that_request(engine) -> None:
    _, c = engine
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(c.endpoint)
    req = build_request([1, 2], None, "rawbad")
    req.params = msgspec.Raw(msgspec.msgpack.encode([{"max_tokens": "many"}]))
    sock.send(encode(req))
    assert sock.poll(30_000)
    reply = msgspec.msgpack.decode(sock.recv())
    sock.close(0)
    ctx.term()
    assert reply["rid"] == "rawbad" and reply["code"] == "invalid_request.params"

"""Bounded connects: a client that no engine answers (it exited, it never existed, it never came up) gets
EngineDeadError with code engine_dead.unreachable naming the endpoint, within its connect_timeout_s; one
whose engine binds late, inside the bound, is served; a call sent before the bound ran out never runs on
an engine that comes up after it."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
import zmq

from tandem import AsyncClient, Client, EngineDeadError, SamplingParams
from tandem.frontend.client.connection import DeathWatch
from tandem.protocol.errors import ErrorCode
from tests.test_lifecycle import _serve

BOUND_S = 1.0
GRACE_S = 20.0  # what "within the bound" may take on a loaded 2-core machine: far below "forever"


def _within(fn, limit_s: float = GRACE_S) -> BaseException:
    """Run fn on a thread; it must raise, and before limit_s (a hung call fails the test, not the suite)."""
    out: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # the test inspects it
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"the call still waits after {limit_s} s"
    assert out, "the call returned instead of raising"
    return out[0]


def _assert_unreachable(e: BaseException, endpoint: str) -> None:
    assert isinstance(e, EngineDeadError), repr(e)
    assert e.code == ErrorCode.UNREACHABLE and endpoint in e.message, (e.code, e.message)


@pytest.fixture(scope="module")
def exited_endpoint(tiny_model) -> str:
    """The endpoint of an engine that was served and then stopped with SIGTERM (exit 0)."""
    proc, endpoint, _ = _serve(tiny_model("llama"))
    with Client(endpoint) as early:  # it served while it was there
        assert early.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)).completion_tokens == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    return endpoint


@pytest.mark.parametrize("where", ["exited", "never existed"])
def test_a_sync_client_with_no_engine_gets_a_typed_error_within_the_bound(
    where, exited_endpoint, tmp_path
) -> None:
    endpoint = exited_endpoint if where == "exited" else f"ipc://{tmp_path}/no-such-engine"
    client = Client(endpoint, connect_timeout_s=BOUND_S)
    try:
        t0 = time.monotonic()
        e = _within(lambda: client.generate("late", SamplingParams(max_tokens=4)))
        _assert_unreachable(e, endpoint)
        assert time.monotonic() - t0 >= BOUND_S * 0.9  # it did wait for the engine, as long as it said
        # Dead from then on, every call at once and typed: stats, streams, sessions.
        for call in (
            client.stats,
            lambda: list(client.stream([1, 2], None)),
            lambda: client.open_session(64),
        ):
            _assert_unreachable(_within(call, 5.0), endpoint)
    finally:
        client.close()


@pytest.mark.parametrize("where", ["exited", "never existed"])
def test_an_async_client_with_no_engine_gets_a_typed_error_within_the_bound(
    where, exited_endpoint, tmp_path
) -> None:
    endpoint = exited_endpoint if where == "exited" else f"ipc://{tmp_path}/no-such-engine"

    async def main() -> BaseException:
        client = AsyncClient(endpoint, connect_timeout_s=BOUND_S)
        try:
            with pytest.raises(EngineDeadError) as first:
                await asyncio.wait_for(client.generate("late", SamplingParams(max_tokens=4)), GRACE_S)
            with pytest.raises(EngineDeadError) as later:  # the streaming call too, at once
                async for _ in client.stream([1, 2]):
                    pass
            _assert_unreachable(later.value, endpoint)
            return first.value
        finally:
            await client.close()

    _assert_unreachable(asyncio.run(main()), endpoint)


def test_the_default_bound_is_a_few_seconds(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/nobody"
    with Client(endpoint) as client:
        t0 = time.monotonic()
        _assert_unreachable(_within(client.stats), endpoint)
        assert 4.0 <= time.monotonic() - t0  # CONNECT_TIMEOUT_S = 5 s, not forever nor at once


def test_an_engine_that_binds_late_inside_the_bound_is_served_and_a_late_one_never_sees_the_call(
    tmp_path,
) -> None:
    """The frontend's end played by a ROUTER: one that binds 0.5 s after the client starts gets its frame;
    one that binds after the bound ran out gets nothing, not even the frame queued before (nothing runs
    for nobody)."""
    ctx = zmq.Context()
    try:
        for late_s, bound_s, delivered in ((0.5, 10.0, True), (2.0, 1.0, False)):
            endpoint = f"ipc://{tmp_path}/frontend-{late_s}"
            client = Client(endpoint, connect_timeout_s=bound_s)
            result: list[BaseException] = []
            t = threading.Thread(
                target=lambda c=client, r=result: r.append(_within(c.stats, GRACE_S)), daemon=True
            )
            t.start()
            time.sleep(late_s)
            frontend = ctx.socket(zmq.ROUTER)
            frontend.bind(endpoint)
            got = frontend.poll(1500)
            assert got == delivered, (late_s, bound_s)
            if delivered:
                assert b"stats" in frontend.recv_multipart()[1]
            frontend.close(0)
            client.close()  # the stats call ends (closed) either way
            t.join(GRACE_S)
            assert result and isinstance(result[0], EngineDeadError)
            if not delivered:
                _assert_unreachable(result[0], endpoint)
    finally:
        ctx.term()


def test_death_watch_bound_in_code(tmp_path) -> None:
    """The policy alone, on a fake clock: unreachable only past the deadline and only while no handshake
    came."""
    now = [100.0]
    watch = DeathWatch("ipc://x", 2.0, clock=lambda: now[0])
    assert watch.unreachable() is None
    now[0] = 102.0
    assert "no engine answers at ipc://x" in (watch.unreachable() or "")
    watch.connected = True
    assert watch.unreachable() is None
    assert DeathWatch("ipc://x", None, clock=lambda: 1e9).unreachable() is None
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="connect_timeout_s"):
            DeathWatch("ipc://x", bad)
    with pytest.raises(ValueError, match="connect_timeout_s"):
        Client(f"ipc://{tmp_path}/x", connect_timeout_s=0)

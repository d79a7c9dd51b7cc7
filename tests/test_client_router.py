"""The sans-IO pieces of the client edge, driven without sockets: the Router both clients share, and the
frontend's guard over client frames."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.frontend.client.request_encoding import build_request
from tandem.frontend.client.router import Router
from tandem.frontend.server.client_frames import MAX_RID_LEN, BadFrames, ClientFrames
from tandem.protocol.codec import encode
from tandem.protocol.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from tandem.protocol.final_info import FinalInfo
from tandem.protocol.messages import (
    AbortRequest,
    EngineStats,
    GenerateRequest,
    OutputBatch,
    RequestError,
    RequestOutput,
)


def _stats(rid: str) -> EngineStats:
    zero = dict.fromkeys(("kv_cached", "kv_cache_locked", "running", "waiting", "inflight_steps", "requests_finished",
                          "requests_aborted", "requests_failed", "retractions", "steps", "prefill_tokens",
                          "decode_tokens"), 0)
    return EngineStats(rid=rid, kv_pool_size=16, kv_free=16, schedule_s=0.0, worker_busy_s=0.0, worker_idle_s=0.0,
                       integrity="ok", **zero)


def test_router_delivers_in_order_and_forgets_a_finished_request() -> None:
    r, got = Router(), []
    assert r.open("a", got.append)
    r.route(OutputBatch([RequestOutput("a", "x", [1]), RequestOutput("zz", "?", [9])]))
    r.route(OutputBatch([RequestOutput("a", "y", [2], FinalInfo("length"))]))
    assert [o.token_ids for o in got] == [[1], [2]] and len(r) == 0
    assert not r.close("a"), "a finished request needs no abort"


def test_router_close_of_a_live_request_asks_for_an_abort_but_not_for_stats() -> None:
    r = Router()
    r.open("a", lambda _: None)
    r.open("s", lambda _: None, is_request=False)
    assert r.close("a") and not r.close("a")
    assert not r.close("s")
    r.route(OutputBatch([RequestOutput("a", "late", [3])]))  # a late delta of a closed call goes nowhere


def test_router_duplicate_rid_and_errors_are_typed() -> None:
    r, got = Router(), []
    r.open("a", got.append)
    assert not r.open("a", got.append)
    assert isinstance(got[-1], InvalidRequestError) and got[-1].code == "invalid_request.duplicate_rid"
    r.route(RequestError("a", "request_failed.oom", "too big"))
    assert isinstance(got[-1], RequestFailedError) and got[-1].code == "request_failed.oom" and len(r) == 0
    r.route(RequestError("", "invalid_request.malformed", "garbage"))  # no request to fail: only logged


def test_router_stats_and_dead_engine() -> None:
    r, got = Router(), []
    r.open("s", got.append, is_request=False)
    r.route(_stats("s"))
    assert isinstance(got[-1], EngineStats)
    r.open("a", got.append)
    r.open("b", got.append)
    r.fail_all("the engine stopped: tandem-worker0 exited with code -9")
    r.fail_all("lost the connection to the engine")  # the first reason is the one that stays
    assert [type(g) for g in got[-2:]] == [EngineDeadError, EngineDeadError]
    assert all("tandem-worker0" in str(g) for g in got[-2:])
    assert not r.open("c", got.append) and isinstance(got[-1], EngineDeadError) and not r.close("a")


FRAMES = ClientFrames(max_request_bytes=4096)


def test_client_frames_accepts_the_client_encoding() -> None:
    req = build_request([1, 2, 3], {"max_tokens": 4}, "r1")
    ident, msg = FRAMES.parse([b"id", encode(req)])  # type: ignore[misc]
    assert ident == b"id" and isinstance(msg, GenerateRequest) and msg.token_ids == [1, 2, 3]
    assert FRAMES.parse([b"id", encode(AbortRequest("r1"))])[1] == AbortRequest("r1")  # type: ignore[index]


@pytest.mark.parametrize(
    ("frames", "code", "answerable"),
    [
        ([b"id", b""], "invalid_request.malformed", False),
        ([b"id", b"\xc1\xff garbage"], "invalid_request.malformed", False),
        ([b"id", b"a", b"b"], "invalid_request.malformed", False),
        ([b"id"], "invalid_request.malformed", False),
        ([b"id", msgspec.msgpack.encode({"type": "nope", "rid": "r9"})], "invalid_request.malformed", True),
        (
            [b"id", msgspec.msgpack.encode({"type": "generate", "rid": "r9", "text": 5})],
            "invalid_request.malformed",
            True,
        ),
        ([b"id", encode(build_request("x" * 5000, None, "big"))], "invalid_request.too_large", True),
        ([b"id", encode(AbortRequest(""))], "invalid_request.rid", False),
        ([b"id", encode(AbortRequest("r" * (MAX_RID_LEN + 1)))], "invalid_request.rid", False),
    ],
)
def test_client_frames_rejects_with_a_typed_reason(frames: list[bytes], code: str, answerable: bool) -> None:
    bad = FRAMES.parse(frames)
    assert isinstance(bad, BadFrames) and bad.code == code and bad.answerable == answerable


@settings(max_examples=500, database=None, derandomize=True)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_client_frames_never_raises(frames: list[bytes]) -> None:
    out = FRAMES.parse(frames)
    assert isinstance(out, (BadFrames, tuple))

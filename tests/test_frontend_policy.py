"""The frontend's routing policy driven without sockets: who may abort, what happens to a client that is
gone or stops reading, and the farewell every waiting call gets when the engine stops."""
from __future__ import annotations

import msgspec
import zmq

from tandem.frontend.client.request_encoding import build_request
from tandem.frontend.server.client_frames import ClientFrames
from tandem.frontend.server.process import Frontend
from tandem.protocol.codec import encode
from tandem.protocol.final_info import FinalInfo
from tandem.protocol.messages import (
    AbortRequest,
    EngineStopping,
    OutputBatch,
    RequestError,
    RequestOutput,
)
from tandem.protocol.model_info import ModelInfo
from tandem.protocol.stop_messages import Drain, DrainRequest


class _Sock:
    """Records what is sent; raises `fail` on a send to a client, as a full or vanished ROUTER peer does."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.sent: list = []
        self.fail = fail

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        if self.fail is not None:
            raise self.fail
        self.sent.append((frames[0], msgspec.msgpack.decode(frames[1])))

    def send(self, data: bytes) -> None:
        self.sent.append(msgspec.msgpack.decode(data))


def _frontend(clients: _Sock) -> tuple[Frontend, _Sock]:
    sched = _Sock()
    fe = Frontend(None, None, clients, None, sched, ClientFrames(1024))  # type: ignore[arg-type]
    fe.owner.update({"a": b"slow", "b": b"slow", "c": b"other"})
    return fe, sched


def test_only_the_submitter_may_abort() -> None:
    fe, sched = _frontend(_Sock())
    fe.on_client_frames([b"other", encode(AbortRequest("a"))])
    assert sched.sent == []
    fe.on_client_frames([b"slow", encode(AbortRequest("a"))])
    assert sched.sent == [{"type": "abort", "rid": "a"}]


def test_a_client_that_stops_reading_or_vanishes_has_its_requests_aborted() -> None:
    for fail in (zmq.Again(), zmq.ZMQError(zmq.EHOSTUNREACH)):
        fe, sched = _frontend(_Sock(fail))
        fe.on_engine(OutputBatch([RequestOutput("a", "x", [1])]))
        assert sorted(m["rid"] for m in sched.sent) == ["a", "b"]
        assert all(m["type"] == "abort" for m in sched.sent)
        assert fe.owner == {"c": b"other"}


def test_a_gone_clients_request_id_stays_in_use_until_the_engine_ends_it() -> None:
    clients = _Sock()
    fe, sched = _frontend(clients)
    fe.info = ModelInfo(100, 64, [0], "llama")
    fe.drop_client(b"slow", "disconnected")  # "a" is aborted, but the scheduler may not know it yet
    reuse = [b"other", encode(build_request([1, 2], None, "a"))]
    fe.on_client_frames(reuse)
    got = [(i, m["rid"], m["code"]) for i, m in clients.sent]
    assert got == [(b"other", "a", "invalid_request.duplicate_rid")]
    fe.on_engine(OutputBatch([RequestOutput("a", "", [], FinalInfo("abort"))]))
    fe.on_client_frames(reuse)
    assert sched.sent[-1]["type"] == "req" and sched.sent[-1]["rid"] == "a" and fe.owner["a"] == b"other"


def test_farewell_tells_every_waiting_call_why_and_stops() -> None:
    clients = _Sock()
    fe, _ = _frontend(clients)
    fe.query_owner["s"] = b"other"
    fe.on_engine(EngineStopping("the engine stopped: tandem-worker0 exited with code -9"))
    assert fe.stopping and fe.owner == {} and fe.query_owner == {}
    got = {(ident, m["rid"]): (m["code"], m["message"]) for ident, m in clients.sent}
    assert set(got) == {(b"slow", "a"), (b"slow", "b"), (b"other", "c"), (b"other", "s")}
    assert all(code == "engine_dead" and "tandem-worker0" in msg for code, msg in got.values())


def test_bad_frames_are_answered_only_when_the_request_is_known_and_not_in_flight() -> None:
    clients = _Sock()
    fe, sched = _frontend(clients)
    fe.on_client_frames([b"slow", msgspec.msgpack.encode({"type": "nope", "rid": "a"})])  # "a" is in flight
    fe.on_client_frames([b"slow", b"\xc1"])  # no request id to answer
    fe.on_client_frames([b"slow", msgspec.msgpack.encode({"type": "nope", "rid": "new"})])
    assert [(i, m["rid"], m["code"]) for i, m in clients.sent] == [
        (b"slow", "new", "invalid_request.malformed")
    ]
    assert sched.sent == [] and set(fe.owner) == {"a", "b", "c"}


def test_a_drain_refuses_new_requests_and_says_drained_once_nothing_is_left() -> None:
    clients, launcher = _Sock(), _Sock()
    fe, sched = _frontend(clients)
    fe.launcher = launcher  # type: ignore[assignment]
    fe.on_engine(Drain("the engine was stopped (SIGTERM)"))
    fe.on_client_frames([b"other", encode(build_request([1, 2], None, "late"))])
    assert [(i, m["rid"], m["code"]) for i, m in clients.sent] == [(b"other", "late", "engine_dead.draining")]
    assert "SIGTERM" in clients.sent[0][1]["message"] and sched.sent == [] and "late" not in fe.owner
    fe.on_engine(OutputBatch([RequestOutput("a", "", [], FinalInfo("length")),
                              RequestOutput("b", "", [], FinalInfo("length"))]))
    fe.on_engine(RequestError("c", "request_failed", "x"))
    assert launcher.sent == [{"type": "drained"}]  # once "c", the last one, ended; and once only
    fe.on_engine(OutputBatch([]))
    assert launcher.sent == [{"type": "drained"}]


def test_a_clients_drain_request_reaches_the_launcher_and_is_answered_with_stats() -> None:
    clients, launcher = _Sock(), _Sock()
    fe, sched = _frontend(clients)
    fe.launcher = launcher  # type: ignore[assignment]
    fe.on_client_frames([b"other", encode(DrainRequest("d", "POST /drain"))])
    assert launcher.sent == [{"type": "drain_request", "rid": "d", "reason": "POST /drain"}]
    assert sched.sent == [{"type": "stats_request", "rid": "d"}] and fe.draining == "POST /drain"

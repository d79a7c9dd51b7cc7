"""Graceful drain, bounded and visible: on SIGTERM (or POST /drain) running requests finish, new ones are
refused with a typed reason (EngineDeadError, engine_dead.draining; HTTP 503 in OpenAI's shape, and /health
says so), the engine exits 0; what still runs when --drain-timeout-s runs out is aborted, typed."""
from __future__ import annotations

import signal
import threading
import time

import httpx2 as httpx
import pytest

from tandem import Client, EngineDeadError, SamplingParams
from tandem.protocol.errors import ErrorCode
from tests.served import Served
from tests.test_lifecycle import _children, _serve, assert_left_last

RUNNING = 8


def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _streams(
    client: Client, n: int, max_tokens: int
) -> tuple[list[threading.Thread], dict, threading.Barrier]:
    """n streams in threads; the barrier opens once each has its first output."""
    results: dict[int, object] = {}
    first = threading.Barrier(n + 1)

    def one(i: int) -> None:
        count, last = 0, None
        try:
            for d in client.stream([5, 6, 7, i], SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
                if count == 0:
                    first.wait(60)
                count += len(d.token_ids)
                last = d
            results[i] = (count, last.finish_reason if last else None)
        except EngineDeadError as e:
            results[i] = e
            if count == 0:
                first.wait(60)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, first


def test_sigterm_lets_running_requests_finish_refuses_new_ones_and_exits_0(tiny_model) -> None:
    proc, endpoint, _ = _serve(tiny_model("llama"), "--drain-timeout-s", "120")
    kids = _children(proc.pid)
    client = Client(endpoint)
    threads, results, first = _streams(client, RUNNING, 400)
    first.wait(60)
    proc.send_signal(signal.SIGTERM)
    _until(lambda: client.stats().draining != "", "the engine never said it drains")
    st = client.stats()
    assert st.draining == "the engine was stopped (SIGTERM)" and st.running + st.waiting == RUNNING, st
    with pytest.raises(EngineDeadError, match="draining") as refused:
        client.generate([1, 2, 3], SamplingParams(max_tokens=2))
    assert refused.value.code == ErrorCode.DRAINING
    for t in threads:
        t.join(120)
    assert results == {i: (400, "length") for i in range(RUNNING)}, results  # every one finished, whole
    assert proc.wait(30) == 0
    assert_left_last(proc, kids)
    client.close()


def test_the_drain_timeout_aborts_what_still_runs(tiny_model) -> None:
    proc, endpoint, _ = _serve(tiny_model("llama"), "--drain-timeout-s", "1")
    kids = _children(proc.pid)
    client = Client(endpoint)
    threads, results, first = _streams(client, 2, 2000)
    first.wait(60)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    for r in results.values():
        assert isinstance(r, EngineDeadError) and r.code == ErrorCode.DRAIN_TIMEOUT, r
        assert "drain timeout (1 s) ran out" in str(r) and "SIGTERM" in str(r)
    assert proc.wait(30) == 0
    assert_left_last(proc, kids)
    client.close()


def test_post_drain_behind_the_admin_key_and_what_http_clients_see(tiny_model) -> None:
    served = Served(
        tiny_model("llama"),
        "--api-key",
        "k",
        "--admin-api-key",
        "admin",
        "--drain-timeout-s",
        "120",
        "--served-model-name",
        "tiny",
    ).ready()
    auth = {"Authorization": "Bearer k"}
    try:
        body = {"model": "tiny", "prompt": "Go on", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", served.url + "/v1/completions", json=body, headers=auth, timeout=120
        ) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            next(lines)  # running
            assert httpx.post(served.url + "/drain").status_code == 401  # not without the key
            # nor the inference key
            for refused in (auth, {"x-api-key": "k"}, {"Authorization": "Bearer admin2"}):
                r = httpx.post(served.url + "/drain", headers=refused)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key", r.text
            assert httpx.get(served.url + "/health").status_code == 200
            r = httpx.post(served.url + "/drain", headers={"Authorization": "Bearer admin"})
            assert r.status_code == 202 and r.json()["status"] == "draining" and r.json()["running"] == 1, (
                r.text
            )
            health = httpx.get(served.url + "/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == ErrorCode.DRAINING
            for stream in (False, True):
                late = httpx.post(served.url + "/v1/completions", headers=auth, timeout=60,
                                  json={"model": "tiny", "prompt": "late", "max_tokens": 2, "stream": stream})
                err = late.json()["error"]
                assert late.status_code == 503 and err["code"] == ErrorCode.DRAINING, late.text
                assert err["type"] == "service_unavailable" and "POST /drain" in err["message"]
            rest = [ln for ln in lines if ln.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2].replace(" ", ""), rest[
            -2:
        ]
        assert served.proc.wait(60) == 0  # drained, so it stopped by itself
    finally:
        served.close()

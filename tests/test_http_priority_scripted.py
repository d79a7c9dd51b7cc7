"""`priority` and `session_params` through the OpenAI routes on scripted replies: each reaches the engine
call as given (default 0 / none), and the bad ones are 400s naming the field, before any engine call."""
from __future__ import annotations

import asyncio

import pytest

from tests.scripted_engine import KEY, NAME, scripted_app, transport

ROUTES = [
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2}),
    (
        "/v1/chat/completions",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
    ("/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 2}),
]


@pytest.fixture(scope="module")
def app(tiny_model):
    return scripted_app(tiny_model("llama"), None)


def _post(app, path: str, body: dict):
    async def go():
        async with transport(app) as http:
            return await http.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})

    return asyncio.run(go())


@pytest.mark.parametrize("path,body", ROUTES)
def test_priority_reaches_the_engine_and_a_bad_one_is_a_400(app, path: str, body: dict) -> None:
    engine, app = app
    for prio in (None, -7, 3):
        r = _post(app, path, body if prio is None else {**body, "priority": prio})
        assert r.status_code == 200, r.text
        assert engine.priorities[-1] == (prio or 0)
    calls = len(engine.priorities)
    for bad in ("high", 1.5, 2**40):
        r = _post(app, path, {**body, "priority": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert len(engine.priorities) == calls


def test_a_session_request_is_one_engine_request(app) -> None:
    engine, app = app
    calls = len(engine.priorities)
    comp, chat = ROUTES[0][1], ROUTES[1][1]
    for path, body in (
        ("/v1/completions", {**comp, "n": 2}),
        ("/v1/completions", {**comp, "prompt": ["a", "b"]}),
        ("/v1/chat/completions", {**chat, "n": 3}),
    ):
        r = _post(app, path, {**body, "session_params": {"id": "s"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_params", r.text
    r = _post(app, "/v1/completions", {**comp, "session_params": {"id": "s", "offset": 3}})
    assert r.status_code == 400 and "offset" in r.json()["error"]["param"], r.text
    assert len(engine.priorities) == calls
    r = _post(app, "/v1/chat/completions", {**chat, "session_params": {"id": "s", "rid": "earlier"}})
    assert r.status_code == 200, r.text
    rid, session = engine.sessions[-1]
    assert rid == r.json()["id"] and (session.id, session.rid) == ("s", "earlier")  # the id names the turn
    _post(app, "/v1/completions", comp)
    assert engine.sessions[-1][1] is None

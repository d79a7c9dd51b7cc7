"""The strict wire check itself (tests/wire_schema.py): each kind of departure from the published schema is
caught where the SDKs' own lenient parsing lets it through, and the scripted transport really checks."""
from __future__ import annotations

import asyncio
import copy

import anthropic.types as at
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from starlette.responses import Response as RawResponse

from tests.scripted_engine import KEY, NAME, scripted_app, transport
from tests.wire_schema import strict

MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 2},
           "content": [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "hi"}]}
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "status": "completed",
            "instructions": None, "metadata": {}, "temperature": 1.0, "top_p": 1.0, "error": None,
            "incomplete_details": None, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]}]}


def _with(obj: dict, path: list, value: object = ..., drop: bool = False) -> dict:
    out = copy.deepcopy(obj)
    node = out
    for k in path[:-1]:
        node = node[k]
    if drop:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def test_valid_bodies_pass() -> None:
    assert strict(at.Message, MESSAGE).content[0].thinking == "hm"
    assert strict(Response, RESPONSE).output[0].content[0].text == "hi"
    delta = {"type": "response.output_text.delta", "sequence_number": 3, "item_id": "msg_1",
             "output_index": 0, "content_index": 0, "delta": "h", "logprobs": []}
    assert strict(ResponseStreamEvent, delta).delta == "h"


@pytest.mark.parametrize(("tp", "body", "says"), [
    (at.Message, _with(MESSAGE, ["content", 1, "index"], 0), "keys the schema does not declare: ['index']"),
    (at.Message, _with(MESSAGE, ["usage", "extra"], 1), "keys the schema does not declare: ['extra']"),
    (at.Message, _with(MESSAGE, ["content", 0, "signature"], drop=True), "signature"),
    (at.Message, _with(MESSAGE, ["usage", "output_tokens"], "2"), "sent '2', read as 2"),
    (Response, _with(RESPONSE, ["instructions"], drop=True), "required key 'instructions' missing"),
    (Response, _with(RESPONSE, ["usage"], None), "'usage' may not be null"),
    (Response, _with(RESPONSE, ["store"], True), "keys the schema does not declare: ['store']"),
    (Response, _with(RESPONSE, ["output", 0, "content", 0, "extra"], 1), "$.output[0].content[0]"),
])
def test_each_departure_is_caught(tp: object, body: dict, says: str) -> None:
    with pytest.raises((AssertionError, ValueError)) as e:
        strict(tp, body)
    assert says in str(e.value)


def test_the_scripted_transport_checks_what_it_got(tiny_model) -> None:
    """A Responses body through transport() is held to the schema on the way out: an extra key fails."""
    _, app = scripted_app(tiny_model("qwen3"), None)

    @app.middleware("http")
    async def spoil(request, call_next):  # the server's answer with one undeclared key
        response = await call_next(request)
        body = b"".join([chunk async for chunk in response.body_iterator]).replace(
            b'"object":"response"', b'"object":"response","store":true')
        return RawResponse(body, response.status_code, media_type="application/json")

    async def go() -> None:
        async with transport(app) as http:
            r = await http.post("/v1/responses", json={"model": NAME, "input": "hi"},
                                headers={"Authorization": f"Bearer {KEY}"})
            assert r.json()["store"] is True

    with pytest.raises(AssertionError, match=r"POST /v1/responses -> 200:\n.*\['store'\]"):
        asyncio.run(go())

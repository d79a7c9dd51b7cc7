"""The Responses API on scripted replies, through the official openai client: items from input to prompt,
output items and typed events (streamed == whole, the SDK's own accumulator agrees), function calls and
their outputs, reasoning items, previous_response_id and its bounded store, errors in OpenAI's shape."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tandem.protocol.errors import InvalidRequestError, RequestFailedError
from tests.scripted_engine import KEY, NAME, Reply, scripted_app, transport
from tests.wire_schema import sse_events

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]


def _pieces(text: str, step: int = 3) -> list[str]:
    return [text[i:i + step] for i in range(0, len(text), step)]


def _run(app, body):
    async def go():
        async with transport(app) as http:
            oai = openai.AsyncOpenAI(
                base_url="http://scripted/v1", api_key=KEY, http_client=http, max_retries=0
            )
            return await body(oai)
    return asyncio.run(go())


def test_text_reply_whole_and_streamed(qwen3, tok) -> None:
    engine, app = scripted_app(qwen3, "qwen3")
    text = "<think>\nA greeting.\n</think>\n\nHello, traveller!"

    async def body(oai):
        engine.script(_pieces(text))
        whole = await oai.responses.create(
            model=NAME, input="hi", instructions="Be kind.", max_output_tokens=40
        )
        engine.script(_pieces(text))
        events = [e async for e in await oai.responses.create(model=NAME, input="hi", instructions="Be kind.",
                                                               max_output_tokens=40, stream=True)]
        engine.script(_pieces(text))
        async with oai.responses.stream(model=NAME, input="hi", instructions="Be kind.") as s:
            final = await s.get_final_response()
        return whole, events, final

    whole, events, final = _run(app, body)
    prompt = tok.decode(engine.prompts[0])
    assert prompt.startswith("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhi<|im_end|>")
    assert engine.params[0]["max_tokens"] == 40
    assert whole.status == "completed" and whole.output_text == "Hello, traveller!"
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "A greeting."
    u = whole.usage
    assert u.input_tokens == len(engine.prompts[0]) and u.output_tokens == len(_pieces(text))
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens_details.reasoning_tokens
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for t in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
              "response.content_part.done", "response.output_item.done", "response.reasoning_text.delta"):
        assert t in types, t
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello, traveller!"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "A greeting."
    done = events[-1].response
    assert done.output_text == whole.output_text and [o.type for o in done.output] == ["reasoning", "message"]
    assert final.output_text == whole.output_text and final.output[0].content[0].text == "A greeting."


def test_function_call_and_its_output_next_turn(qwen3, tok) -> None:
    engine, app = scripted_app(qwen3, None)

    async def body(oai):
        engine.script(_pieces(f"Let me check.\n{CALL}", 4))
        first = await oai.responses.create(model=NAME, input="weather in Paris?", tools=TOOLS)
        engine.script(_pieces(f"Let me check.\n{CALL}", 4))
        events = [
            e
            async for e in await oai.responses.create(
                model=NAME, input="weather in Paris?", tools=TOOLS, stream=True
            )
        ]
        call = next(o for o in first.output if o.type == "function_call")
        engine.script(["It is sunny."])
        second = await oai.responses.create(model=NAME, previous_response_id=first.id, tools=TOOLS, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])
        # The same turn sent whole: the earlier output items go back in as input.
        engine.script(["It is sunny."])
        again = await oai.responses.create(
            model=NAME,
            tools=TOOLS,
            input=[
                {"role": "user", "content": "weather in Paris?"},
                *[o.model_dump(exclude_none=True) for o in first.output],
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"},
            ],
        )
        return first, events, second, again

    first, events, second, again = _run(app, body)
    assert [o.type for o in first.output] == ["message", "function_call"]
    assert first.output[0].content[0].text == "Let me check."
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.call_id.startswith("call_") and call.status == "completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    # streamed in pieces
    assert len([e for e in events if e.type == "response.function_call_arguments.delta"]) > 1
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [
        call.arguments
    ]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call"]
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    # The second turn's prompt holds the first: the question, the call, its output.
    prompt = tok.decode(engine.prompts[2])
    assert "weather in Paris?" in prompt and "sunny, 21C" in prompt and "<|im_start|>tool" in prompt
    assert engine.prompts[2] == engine.prompts[3]


def test_previous_response_unknown_or_evicted_is_a_404(qwen3) -> None:
    engine, app = scripted_app(qwen3, None, store=2)

    async def body(oai):
        ids = [(await oai.responses.create(model=NAME, input=f"turn {i}")).id for i in range(3)]
        with pytest.raises(openai.NotFoundError) as e:
            await oai.responses.create(model=NAME, input="more", previous_response_id=ids[0])  # evicted
        err = e.value.response.json()["error"]
        assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
        assert "keeps the last 2" in err["message"]
        with pytest.raises(openai.NotFoundError):
            await oai.responses.create(model=NAME, input="more", previous_response_id="resp_never")
        ok = await oai.responses.create(model=NAME, input="more", previous_response_id=ids[2])
        got = await oai.responses.retrieve(ids[2])  # kept: used last (ids[1] made way for ok)
        not_stored = await oai.responses.create(model=NAME, input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            await oai.responses.retrieve(not_stored.id)
        return ok, got, ids

    ok, got, ids = _run(app, body)
    assert ok.status == "completed" and got.id == ids[2]


def test_structured_output_limits_and_cut_off(qwen3) -> None:
    engine, app = scripted_app(qwen3, None)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    async def body(oai):
        engine.script(['{"a": 1}'])
        r = await oai.responses.create(
            model=NAME,
            input="json",
            text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
            temperature=0.5,
            top_p=0.9,
        )
        engine.script(Reply(["cut", " off"], "length"))
        cut = await oai.responses.create(model=NAME, input="long", max_output_tokens=2, stream=True)
        cut_events = [e async for e in cut]
        engine.script(['{"name": "get_weather", "arguments": {"city": "Oslo"}}'])
        forced = await oai.responses.create(model=NAME, input="w", tools=TOOLS,
                                            tool_choice={"type": "function", "name": "get_weather"})
        return r, cut_events, forced

    r, cut_events, forced = _run(app, body)
    assert engine.params[0]["json_schema"] == schema and engine.params[0]["temperature"] == 0.5
    assert json.loads(r.output_text) == {"a": 1}
    assert cut_events[-1].type == "response.incomplete"
    final = cut_events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.output_text == "cut off"
    # a named function: its arguments' schema
    assert engine.params[2]["json_schema"] == TOOLS[0]["parameters"]
    assert forced.output[0].type == "function_call" and json.loads(forced.output[0].arguments) == {
        "name": "get_weather", "arguments": {"city": "Oslo"}}


def test_bad_input_is_a_400_and_the_server_keeps_serving(qwen3) -> None:
    engine, app = scripted_app(qwen3, None)

    async def body(oai):
        bad = [dict(input=[{"type": "bogus"}]), dict(input="x", tools=[{"type": "web_search"}]),
               dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
               dict(input="x", max_output_tokens=0), dict(input="x", extra_body={"frobnicate": 1}),
               dict(input="x", tool_choice="required")]
        for kw in bad:
            with pytest.raises(openai.BadRequestError) as e:
                await oai.responses.create(model=NAME, **kw)
            err = e.value.response.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], kw
        with pytest.raises(openai.NotFoundError):
            await oai.responses.create(model="gpt-4o", input="x")
        engine.script(Reply([], error=InvalidRequestError("top_k must be -1 or at least 1")))
        with pytest.raises(openai.BadRequestError):  # the engine's refusal, streamed: an HTTP status
            await oai.responses.create(model=NAME, input="x", stream=True, extra_body={"top_k": 0})
        return await oai.responses.create(model=NAME, input="still serving")

    assert _run(app, body).output_text == "ok"


def test_a_fault_mid_reply_ends_the_stream_with_an_error_event(qwen3) -> None:
    """Raw SSE (the SDK raises on an error event): what went out before it, then the error in the
    published event's shape (transport() holds every event to it)."""
    engine, app = scripted_app(qwen3, None)

    async def go():
        async with transport(app) as http:
            engine.script(Reply(["Hel", "lo"], fault=RequestFailedError("the worker died", "request_failed.internal")))
            return await http.post("/v1/responses", json={"model": NAME, "input": "hi", "stream": True},
                                   headers={"Authorization": f"Bearer {KEY}"})

    events = [e for _, e in sse_events(asyncio.run(go()).text)]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello"
    assert events[-1] == {"type": "error", "sequence_number": len(events) - 1, "code": "request_failed.internal",
                          "message": "the worker died", "param": None}

"""Anthropic's Messages API on scripted replies, through the official anthropic client: blocks to prompt,
content blocks and events (streamed == whole, the SDK's own accumulator agrees), thinking, tool use and
tool results, stop reasons, x-api-key, count_tokens, errors in Anthropic's shape."""
from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from tandem.protocol.errors import InvalidRequestError, RequestFailedError
from tests.scripted_engine import KEY, NAME, Reply, scripted_app, transport
from tests.wire_schema import sse_events

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "name": "get_weather",
        "description": "weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
USER = [{"role": "user", "content": "weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _pieces(text: str, step: int = 3) -> list[str]:
    return [text[i:i + step] for i in range(0, len(text), step)]


def _run(app, body, key: str = KEY):
    async def go():
        async with transport(app) as http:
            client = anthropic.AsyncAnthropic(base_url="http://scripted", api_key=key, http_client=http,
                                              max_retries=0)
            return await body(client)
    return asyncio.run(go())


def test_thinking_and_text_whole_streamed_and_accumulated(qwen3, tok) -> None:
    engine, app = scripted_app(qwen3, "qwen3")
    text = "<think>\nThey want weather.\n</think>\n\nIt is sunny."

    async def body(c):
        kw = dict(model=NAME, max_tokens=64, system=[{"type": "text", "text": "Be brief.",
                                                      "cache_control": {"type": "ephemeral"}}], messages=USER)
        engine.script(_pieces(text))
        whole = await c.messages.create(**kw)
        engine.script(_pieces(text))
        events = [e async for e in await c.messages.create(**kw, stream=True)]
        engine.script(_pieces(text))
        async with c.messages.stream(**kw) as s:
            final = await s.get_final_message()
        return whole, events, final

    whole, events, final = _run(app, body)
    assert tok.decode(engine.prompts[0]).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "They want weather." and whole.content[1].text == "It is sunny."
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None and whole.role == "assistant"
    assert whole.usage.input_tokens == len(engine.prompts[0]) and whole.usage.output_tokens == len(
        _pieces(text)
    )
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types.count("content_block_start") == types.count("content_block_stop") == 2
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "They want weather."
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "It is sunny."
    assert (
        events[-2].delta.stop_reason == "end_turn"
        and events[-2].usage.output_tokens == whole.usage.output_tokens
    )
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "end_turn"


def test_tool_use_and_tool_result(qwen3, tok) -> None:
    engine, app = scripted_app(qwen3, None)

    async def body(c):
        engine.script(_pieces(f"Checking.\n{CALL}", 5))
        whole = await c.messages.create(model=NAME, max_tokens=64, messages=USER, tools=TOOLS)
        engine.script(_pieces(f"Checking.\n{CALL}", 5))
        events = [
            e
            async for e in await c.messages.create(
                model=NAME, max_tokens=64, messages=USER, tools=TOOLS, stream=True
            )
        ]
        use = whole.content[1]
        engine.script(["Sunny."])
        after = await c.messages.create(
            model=NAME,
            max_tokens=64,
            tools=TOOLS,
            messages=[
                *USER,
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": "21C, clear"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
        )
        return whole, events, after

    whole, events, after = _run(app, body)
    assert [b.type for b in whole.content] == ["text", "tool_use"] and whole.stop_reason == "tool_use"
    use = whole.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert (
        [b.type for b in starts] == ["text", "tool_use"]
        and starts[1].name == use.name
        and starts[1].input == {}
    )
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"
             and e.delta.type == "input_json_delta"]
    assert len(parts) > 1 and json.loads("".join(parts)) == {"city": "Paris"}
    assert events[-2].delta.stop_reason == "tool_use"
    prompt = tok.decode(engine.prompts[2])
    assert "<|im_start|>tool\n21C, clear<|im_end|>\n<|im_start|>user\nAnd tomorrow?" in prompt
    assert after.content[0].text == "Sunny."


def test_stop_reasons_sampling_and_forced_tools(qwen3) -> None:
    engine, app = scripted_app(qwen3, None)

    async def body(c):
        engine.script(Reply(["The end"], "stop", matched_stop="END"))
        # Sampling fields this SDK no longer spells out (older ones and other clients still send them).
        stopped = await c.messages.create(model=NAME, max_tokens=9, messages=USER, stop_sequences=["END"],
                                          extra_body={"temperature": 0.3, "top_p": 0.8, "top_k": 5})
        engine.script(Reply(["cut"], "length"))
        cut = await c.messages.create(model=NAME, max_tokens=1, messages=USER)
        engine.script(['{"city": "Oslo"}'])
        forced = await c.messages.create(model=NAME, max_tokens=20, messages=USER, tools=TOOLS,
                                         tool_choice={"type": "tool", "name": "get_weather"})
        engine.script(['[{"name": "get_weather", "arguments": {"city": "Rome"}}]'])
        anyone = await c.messages.create(model=NAME, max_tokens=20, messages=USER, tools=TOOLS,
                                         tool_choice={"type": "any", "disable_parallel_tool_use": True})
        engine.script(['{"a": 1}'])
        structured = await c.messages.create(
            model=NAME,
            max_tokens=20,
            messages=USER,
            cache_control={"type": "ephemeral"},
            output_config={"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}},
        )
        return stopped, cut, forced, anyone, structured

    stopped, cut, forced, anyone, structured = _run(app, body)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    p = engine.params[0]
    assert (p["stop"], p["temperature"], p["top_p"], p["top_k"], p["max_tokens"]) == (["END"], 0.3, 0.8, 5, 9)
    assert cut.stop_reason == "max_tokens"
    assert engine.params[2]["json_schema"] == TOOLS[0]["input_schema"]
    assert forced.stop_reason == "tool_use" and forced.content[0].input == {"city": "Oslo"}
    assert engine.params[3]["json_schema"]["maxItems"] == 1
    assert anyone.content[0].name == "get_weather" and anyone.content[0].input == {"city": "Rome"}
    assert engine.params[4]["json_schema"] == SCHEMA and json.loads(structured.content[0].text) == {"a": 1}


def test_count_tokens_and_thinking_switch(qwen3, tok) -> None:
    engine, app = scripted_app(qwen3, "auto")

    async def body(c):
        n = await c.messages.count_tokens(model=NAME, messages=USER, system="Be brief.")
        await c.messages.create(model=NAME, max_tokens=5, messages=USER, system="Be brief.")
        await c.messages.create(model=NAME, max_tokens=5, messages=USER, thinking={"type": "disabled"})
        await c.messages.create(model=NAME, max_tokens=5, messages=USER, thinking={"type": "adaptive"})
        return n

    n = _run(app, body)
    assert n.input_tokens == len(engine.prompts[0])
    assert tok.decode(engine.prompts[1]).endswith("assistant\n<think>\n\n</think>\n\n")
    # adaptive: the template's default
    assert tok.decode(engine.prompts[2]).endswith("<|im_start|>assistant\n")


def test_errors_in_anthropic_shape_and_the_server_keeps_serving(qwen3) -> None:
    engine, app = scripted_app(qwen3, None)

    def shape(e: anthropic.APIStatusError, kind: str) -> None:
        body = e.response.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body

    async def bad_key(c):
        with pytest.raises(anthropic.AuthenticationError) as e:
            await c.messages.create(model=NAME, max_tokens=5, messages=USER)
        shape(e.value, "authentication_error")

    _run(app, bad_key, key="wrong")

    async def body(c):
        # The SDK checks max_tokens itself; a raw request without it gets the server's 400.
        async with transport(app) as http:
            raw = await http.post(
                "/v1/messages", headers={"x-api-key": KEY}, json={"model": NAME, "messages": USER}
            )
        assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in raw.json()["error"]["message"]
        bad = [dict(max_tokens=5, messages=[]), dict(max_tokens=0, messages=USER),
               dict(max_tokens=5, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
               dict(max_tokens=5, messages=USER, extra_body={"temperature": 1.5}),
               dict(max_tokens=5, messages=USER, extra_body={"bogus": 1}),
               dict(max_tokens=5, messages=USER, tool_choice={"type": "any"}),
               dict(max_tokens=5, messages=USER, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})]
        for kw in bad:
            with pytest.raises(anthropic.BadRequestError) as e:
                await c.messages.create(model=NAME, **kw)
            shape(e.value, "invalid_request_error")
        with pytest.raises(anthropic.NotFoundError) as e:
            await c.messages.create(model="claude-x", max_tokens=5, messages=USER)
        shape(e.value, "not_found_error")
        engine.script(Reply([], error=InvalidRequestError("prompt too long")))
        with pytest.raises(anthropic.BadRequestError) as e:  # the engine's refusal, streamed: an HTTP status
            await c.messages.create(model=NAME, max_tokens=5, messages=USER, stream=True)
        shape(e.value, "invalid_request_error")
        return await c.messages.create(model=NAME, max_tokens=5, messages=USER)

    assert _run(app, body).content[0].text == "ok"


def test_a_fault_mid_reply_ends_the_stream_with_an_error_event(qwen3) -> None:
    """Raw SSE (the SDK raises on an error event): the text that went out, then Anthropic's error event
    (transport() holds every event to the SDK's types)."""
    engine, app = scripted_app(qwen3, None)

    async def go():
        async with transport(app) as http:
            engine.script(Reply(["Hel", "lo"], fault=RequestFailedError("the worker died", "request_failed.internal")))
            return await http.post("/v1/messages", headers={"x-api-key": KEY},
                                   json={"model": NAME, "max_tokens": 9, "messages": USER, "stream": True})

    events = [e for _, e in sse_events(asyncio.run(go()).text)]
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "error"]
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "the worker died"}}

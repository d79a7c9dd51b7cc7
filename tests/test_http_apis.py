"""The agent-facing routes against a served tiny qwen3 (its template has Qwen3's think switch) with
`--reasoning-parser auto`: chat with reasoning (think markers forced by a regex: the random model never
writes them, and this tokenizer cuts each marker into several tokens), the Responses API through the
official openai client, the Messages API through the official anthropic client; all equal to what the
engine generates for the same conversation, streamed == whole, and the engine idle afterwards. Every
Responses and Messages body the clients get (whole, each streamed event, errors) is also held strictly to
the SDKs' types, which the clients themselves read leniently (tests/wire_schema.py)."""
from __future__ import annotations

import json
import re

import anthropic
import httpx2 as httpx
import openai
import pytest

from tests.conftest import check_idle_engine
from tests.served import Served
from tests.wire_schema import Recorder

KEY = "sk-apis"
NAME = "tiny-qwen3"
THINK = r"<think>\n[a-z]{2,7}( [a-z]{2,7}){1,3}\n</think>\n\n[A-Z][a-z]{2,7}( [a-z]{2,7}){0,3}\."
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tiny_model):
    s = Served(tiny_model("qwen3"), "--kv-cache-tokens", "4096", "--max-running-requests", "16",
               "--api-key", KEY, "--served-model-name", NAME, "--reasoning-parser", "auto").ready()
    yield s
    assert s.close() == 0


@pytest.fixture(scope="module")
def engine(served):
    from tandem import Client

    c = Client(served.endpoint, reasoning_parser="qwen3")
    yield c
    c.close()


@pytest.fixture(scope="module")
def wire() -> Recorder:
    """Every answer the clients below get, kept for the strict check (`wire.check()`)."""
    return Recorder(httpx.HTTPTransport())


@pytest.fixture(scope="module")
def oai(served, wire):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                         http_client=httpx.Client(transport=wire))


@pytest.fixture(scope="module")
def claude(served, wire):
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0, timeout=60,
                               http_client=httpx.Client(transport=wire))


def test_chat_reasoning_streamed_whole_and_in_the_python_client(oai, engine, tiny_model) -> None:
    from tandem.protocol.tokenizer_loader import load_tokenizer

    assert len(load_tokenizer(tiny_model("qwen3")).encode("<think>")) > 1  # markers span tokens here
    msgs = [{"role": "user", "content": "think first"}]
    kw = dict(model=NAME, messages=msgs, max_tokens=60, seed=3, extra_body={"regex": THINK})
    whole = oai.chat.completions.create(**kw).choices[0]
    reasoning, content = whole.message.reasoning_content, whole.message.content
    assert re.fullmatch(r"[a-z]+( [a-z]+)+", reasoning) and re.fullmatch(r"[A-Z][a-z ]+\.", content)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thoughts = [getattr(d, "reasoning_content", None) or "" for d in deltas]  # not in the SDK's delta type
    assert "".join(thoughts) == reasoning and "".join(d.content or "" for d in deltas) == content
    assert not any("<" in (d.content or "") + t for d, t in zip(deltas, thoughts))
    ref = engine.generate(msgs, {"max_tokens": 60, "seed": 3, "regex": THINK})
    assert (ref.reasoning_text, ref.content) == (reasoning, content) and ref.text.startswith("<think>")
    off = oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=4,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > oai.chat.completions.create(model=NAME, messages=msgs,
                                                                 max_tokens=4).usage.prompt_tokens


def test_responses_with_the_openai_client(oai, engine, wire) -> None:
    r = oai.responses.create(model=NAME, input="Hello there", max_output_tokens=12, temperature=0)
    ref = engine.generate(
        [{"role": "user", "content": "Hello there"}], {"max_tokens": 12, "temperature": 0.0}
    )
    # a whole reply, not an end-of-sequence after a token or two that any door would pass on alike
    assert ref.finish_reason == "length" and ref.completion_tokens == 12 and len(ref.text) > 12
    assert r.output_text == ref.text and r.usage.output_tokens == ref.completion_tokens
    assert r.usage.input_tokens == ref.prompt_tokens
    assert r.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    events = list(oai.responses.create(model=NAME, input="Hello there", max_output_tokens=12, temperature=0,
                                       stream=True))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    # The next turn continues the stored conversation: the same as sending it whole.
    nxt = oai.responses.create(model=NAME, input="And then?", previous_response_id=r.id, max_output_tokens=8,
                               temperature=0)
    ref2 = engine.generate(
        [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": r.output_text},
            {"role": "user", "content": "And then?"},
        ],
        {"max_tokens": 8, "temperature": 0.0},
    )
    assert ref2.completion_tokens == 8 and len(ref2.text) > 8
    assert nxt.output_text == ref2.text and nxt.usage.input_tokens == ref2.prompt_tokens
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=NAME, input="x", previous_response_id="resp_unknown")
    assert wire.check() == 4


def test_responses_tool_call_streamed_and_whole(oai, wire) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    kw = dict(model=NAME, input="weather?", tools=tools, tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=60, temperature=0)
    whole = oai.responses.create(**kw)
    call = next(o for o in whole.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    events = list(oai.responses.create(**kw, stream=True))
    assert (
        "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        == call.arguments
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    follow = oai.responses.create(
        model=NAME,
        previous_response_id=whole.id,
        tools=tools,
        max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert follow.status in ("completed", "incomplete")
    assert wire.check() == 3


def test_messages_with_the_anthropic_client(claude, engine, wire) -> None:
    msgs = [{"role": "user", "content": "Hello there"}]
    m = claude.messages.create(model=NAME, max_tokens=12, messages=msgs, extra_body={"temperature": 0})
    ref = engine.generate(msgs, {"max_tokens": 12, "temperature": 0.0})
    assert ref.finish_reason == "length" and ref.completion_tokens == 12 and len(ref.text) > 12  # whole
    assert m.content[0].type == "text" and m.content[0].text == ref.text
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.prompt_tokens
    assert m.usage.output_tokens == ref.completion_tokens
    events = list(
        claude.messages.create(
            model=NAME, max_tokens=12, messages=msgs, extra_body={"temperature": 0}, stream=True
        )
    )
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == ref.text
    assert events[-2].delta.stop_reason == m.stop_reason and events[-1].type == "message_stop"
    assert claude.messages.count_tokens(model=NAME, messages=msgs).input_tokens == ref.prompt_tokens
    assert wire.check() == 3


def test_messages_tool_use_streamed_and_whole(claude, wire) -> None:
    kw = dict(
        model=NAME,
        max_tokens=40,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[{"name": "get_weather", "input_schema": CITY}],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use" and m.content[0].type == "tool_use"
    assert m.content[0].name == "get_weather" and m.content[0].input["city"] in ("Paris", "Oslo")
    with claude.messages.stream(**kw) as s:
        parts = [e.delta.partial_json for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert json.loads("".join(parts)) == m.content[0].input == final.content[0].input
    assert wire.check() == 2


def test_bad_input_on_each_new_route_and_still_serving(served, claude, oai, engine, wire) -> None:
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0,
                            http_client=httpx.Client(transport=wire)).messages.create(
            model=NAME, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.response.json()["error"]["type"] == "authentication_error"
    r = httpx.Client(transport=wire).post(served.url + "/v1/messages", headers={"x-api-key": KEY},
                                          content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=NAME, max_tokens=4, messages=[{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f"}]}])
    assert e.value.response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=NAME, input=[{"type": "function_call_output"}])
    assert e.value.response.json()["error"]["type"] == "invalid_request_error"
    assert claude.messages.create(
        model=NAME, max_tokens=2, messages=[{"role": "user", "content": "x"}]
    ).content
    assert oai.responses.create(model=NAME, input="x", max_output_tokens=2).output
    assert wire.check() == 6
    check_idle_engine(engine)

"""Reasoning output through the chat completions door, on scripted replies (a random model never writes
think markers): the official openai client, whole and streamed, the markers cut in every way."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tandem.protocol.tokenizer_loader import load_tokenizer
from tests.scripted_engine import KEY, NAME, Reply, scripted_app, transport

REPLY = "<think>\nThe user says hi.\nI answer.\n</think>\n\nHello there!"


def _cuts(text: str, how: str) -> list[str]:
    if how == "chars":
        return list(text)
    if how == "whole":
        return [text]
    step = int(how)
    return [text[i:i + step] for i in range(0, len(text), step)]


def _run(coro):
    return asyncio.run(coro)


async def _chat(app, engine, pieces: list[str] | Reply, **kw) -> tuple:
    async with transport(app) as http:
        oai = openai.AsyncOpenAI(base_url="http://scripted/v1", api_key=KEY, http_client=http, max_retries=0)
        args = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=50, **kw)
        engine.script(pieces)
        whole = (await oai.chat.completions.create(**args)).choices[0]
        engine.script(pieces)
        chunks = [c async for c in await oai.chat.completions.create(**args, stream=True)]
    return whole, chunks


def _streamed(chunks) -> tuple[str, str, list]:
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    return reasoning, content, calls


@pytest.mark.parametrize("how", ["whole", "chars", "2", "3", "5"])
def test_reasoning_content_whole_and_streamed(qwen3, how) -> None:
    engine, app = scripted_app(qwen3, "qwen3")
    whole, chunks = _run(_chat(app, engine, _cuts(REPLY, how)))
    assert whole.message.reasoning_content == "The user says hi.\nI answer."
    assert whole.message.content == "Hello there!" and whole.finish_reason == "stop"
    reasoning, content, _ = _streamed(chunks)
    assert (reasoning, content) == ("The user says hi.\nI answer.", "Hello there!")
    for c in chunks:  # no piece of a marker ever goes out
        d = c.choices[0].delta if c.choices else None
        if d is not None:
            assert "<" not in (d.content or "") + (getattr(d, "reasoning_content", None) or "")


def test_no_think_block_is_all_content_and_no_parser_changes_nothing(qwen3) -> None:
    engine, app = scripted_app(qwen3, "qwen3")
    whole, chunks = _run(_chat(app, engine, ["Plain", " answer."]))
    assert whole.message.content == "Plain answer." and whole.message.reasoning_content is None
    assert _streamed(chunks)[:2] == ("", "Plain answer.")
    engine, app = scripted_app(qwen3, None)  # no --reasoning-parser: the text as the model wrote it
    whole, _ = _run(_chat(app, engine, _cuts(REPLY, "4")))
    assert whole.message.content == REPLY and "reasoning_content" not in whole.message.model_extra


def test_deepseek_r1_reply_starts_inside_the_reasoning(qwen3) -> None:
    engine, app = scripted_app(qwen3, "deepseek-r1")
    whole, chunks = _run(_chat(app, engine, _cuts("Let me see: 4.\n</think>\n\nIt is 4.", "3")))
    assert (whole.message.reasoning_content, whole.message.content) == ("Let me see: 4.", "It is 4.")
    assert _streamed(chunks)[:2] == ("Let me see: 4.", "It is 4.")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("how", ["whole", "chars", "7"])
def test_tool_calls_come_from_the_content_only(qwen3, how) -> None:
    engine, app = scripted_app(qwen3, "qwen3")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = f"<think>I could write {call} here, but I think first.</think>\n\nChecking.\n{call}"
    whole, chunks = _run(_chat(app, engine, _cuts(text, how), tools=TOOLS))
    assert whole.message.reasoning_content == f"I could write {call} here, but I think first."
    assert whole.message.content == "Checking." and whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    reasoning, content, calls = _streamed(chunks)
    assert reasoning == whole.message.reasoning_content and content == "Checking."
    assert calls[0].function.name == "get_weather"
    assert (
        "".join(c.function.arguments or "" for c in calls) == whole.message.tool_calls[0].function.arguments
    )


def test_chat_template_kwargs_reach_the_template(qwen3) -> None:
    engine, app = scripted_app(qwen3, "auto")

    async def go() -> None:
        async with transport(app) as http:
            oai = openai.AsyncOpenAI(
                base_url="http://scripted/v1", api_key=KEY, http_client=http, max_retries=0
            )
            msgs = [{"role": "user", "content": "hi"}]
            await oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=5)
            await oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=5,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            with pytest.raises(openai.BadRequestError) as e:
                await oai.chat.completions.create(model=NAME, messages=msgs, max_tokens=5,
                                                  extra_body={"chat_template_kwargs": {"tokenize": False}})
            assert "tokenize" in e.value.response.json()["error"]["message"]

    _run(go())
    tok = load_tokenizer(qwen3)
    on, off = (tok.decode(p) for p in engine.prompts)
    assert on.endswith("<|im_start|>assistant\n") and off.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_reply_cut_off_while_thinking(qwen3) -> None:
    engine, app = scripted_app(qwen3, "qwen3")
    whole, chunks = _run(_chat(app, engine, Reply(["<think>", "\nstill thinking", " </thi"], "length")))
    assert whole.finish_reason == "length" and whole.message.reasoning_content == "still thinking </thi"
    assert whole.message.content == ""
    assert _streamed(chunks)[:2] == ("still thinking </thi", "")

"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens.

The conversation goes through the model's chat template like a chat completion (system, user and
assistant turns, tool_use as tool calls, tool_result as tool messages), the reply through the same reply
parser (thinking, then tool calls), and the content blocks come back whole or as Anthropic's events.
Errors on these routes are in Anthropic's shape (errors.py); the key may come as `x-api-key`.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.anthropic_output import MessageBuilder
from tandem.frontend.http.anthropic_schema import (
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from tandem.frontend.http.chat import ToolSetup
from tandem.frontend.http.chat_prompt import chat_prompt, prompt_ids
from tandem.frontend.http.choices import ChoiceRun
from tandem.frontend.http.errors import APIError, anthropic_error_body
from tandem.frontend.http.reply import ReplyParser
from tandem.frontend.http.sampling import with_tools
from tandem.frontend.http.schemas import (
    ChatMessageBody,
    FunctionCall,
    FunctionDef,
    ImageURL,
    ImageURLPart,
    TextPart,
    ToolCall,
)
from tandem.frontend.http.state import ServerState
from tandem.frontend.http.streaming import sse, stream_response, until_disconnect
from tandem.frontend.http.usage import Usage
from tandem.protocol.image_item import ImagePrompt


def _joined(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_messages(body: CountTokensRequest) -> list[ChatMessageBody]:
    out = [ChatMessageBody(role="system", content=_joined(body.system))] if body.system else []
    for m in body.messages:
        if isinstance(m.content, str):
            out.append(ChatMessageBody(role=m.role, content=m.content))
            continue
        text, calls, thinking, parts = "", [], None, []
        for b in m.content:
            if isinstance(b, TextBlock):
                text += b.text
                parts.append(TextPart(type="text", text=b.text))
            elif isinstance(b, ImageBlock):
                parts.append(ImageURLPart(type="image_url", image_url=ImageURL(url=b.url)))
            elif isinstance(b, ToolUseBlock):
                calls.append(
                    ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                )
            elif isinstance(b, ToolResultBlock):
                if text:  # text before a result stays before it
                    out.append(ChatMessageBody(role=m.role, content=text))
                    text = ""
                result = _joined(b.content)
                out.append(ChatMessageBody(role="tool", tool_call_id=b.tool_use_id,
                                       content=f"Error: {result}" if b.is_error else result))
            elif isinstance(b, ThinkingBlock):
                thinking = b.thinking
        images = any(isinstance(p, ImageURLPart) for p in parts)
        content: str | list | None = parts if images else text or None
        if content or calls or not m.content:
            out.append(ChatMessageBody(role=m.role, content=content, tool_calls=calls or None,
                                   reasoning_content=thinking if m.role == "assistant" else None))
    return out


def _tools(body: CountTokensRequest) -> ToolSetup:
    fns = [
        FunctionDef(name=t.name, description=t.description, parameters=t.input_schema)
        for t in body.tools or []
    ]
    tc = body.tool_choice
    parallel = not (tc and tc.disable_parallel_tool_use)
    if tc is None or tc.type == "auto":
        return ToolSetup(fns, "auto", None, parallel)
    if tc.type == "tool":
        if tc.name is None:
            raise APIError(400, "tool_choice.name is required with type tool", "tool_choice.name")
        return ToolSetup(fns, "named", tc.name, parallel)
    return ToolSetup(fns, "required" if tc.type == "any" else "none", None, parallel)


async def _prompt(st: ServerState, body: CountTokensRequest, tools: ToolSetup) -> list[int] | ImagePrompt:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.thinking is not None and body.thinking.type != "adaptive":
        kwargs.setdefault("enable_thinking", body.thinking.type == "enabled")
    return await chat_prompt(st, chat_messages(body), tools.template_tools(), True, kwargs)


async def count_message_tokens(st: ServerState, body: CountTokensRequest) -> dict:
    await st.check_model(body.model)
    return {"input_tokens": len(prompt_ids(await _prompt(st, body, _tools(body))))}


def _params(body: MessagesRequest, tools: ToolSetup) -> dict[str, Any]:
    p: dict[str, Any] = {"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                         "top_k": body.top_k, "stop": body.stop_sequences}
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        p["json_schema"] = fmt.schema_
    return with_tools({k: v for k, v in p.items() if v is not None}, tools)


def _stop(body: MessagesRequest, reply: ReplyParser) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the finished reply."""
    final = reply.final
    assert final is not None
    if final.finish_reason == "length":
        return "max_tokens", None
    if reply.calls:
        return "tool_use", None
    if isinstance(final.matched_stop, str) and final.matched_stop in (body.stop_sequences or []):
        return "stop_sequence", final.matched_stop
    return "end_turn", None


def _usage(usage: Usage) -> dict:
    # Anthropic counts the prompt tokens read from the cache apart from input_tokens.
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


async def create_message(st: ServerState, body: MessagesRequest, request: Request) -> Response:
    lora = await st.check_model(body.model)
    tools = _tools(body)
    prompt = await _prompt(st, body, tools)
    ids = prompt_ids(prompt)
    run = ChoiceRun(st.client, st.metrics, [prompt], [_params(body, tools)], lora=lora)
    reply = ReplyParser(st.reasoning_parser(ids), tools.parser())
    out = MessageBuilder()
    usage = Usage()
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": st.model_name}

    def on(d: CompletionDelta) -> list[dict]:
        usage.add(d, 0)
        events = out.add(reply.add(d))
        return events + out.finish() if d.finished else events

    if not body.stream:
        async def collect() -> None:
            async for _, d in run:
                on(d)

        await until_disconnect(request, collect())
        stop_reason, stop_sequence = _stop(body, reply)
        return JSONResponse({**head, "content": out.content(), "stop_reason": stop_reason,
                             "stop_sequence": stop_sequence, "usage": _usage(usage)})

    async def events(deltas: AsyncIterator[tuple[int, CompletionDelta]]) -> AsyncIterator[bytes]:
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(ids), "output_tokens": 0}}
        yield sse({"type": "message_start", "message": start}, "message_start")
        async for _, d in deltas:
            for e in on(d):
                yield sse(e, e["type"])
        stop_reason, stop_sequence = _stop(body, reply)
        yield sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": _usage(usage),
            },
            "message_delta",
        )
        yield sse({"type": "message_stop"}, "message_stop")

    def error_event(err: APIError) -> bytes:
        return sse(anthropic_error_body(err.status, err.message), "error")

    return await stream_response(request, run, events, error_event, done=None)

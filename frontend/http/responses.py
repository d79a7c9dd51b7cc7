"""POST /v1/responses (OpenAI's Responses API): input items into a chat, one reply, output items back,
whole or as typed events; `previous_response_id` continues a stored conversation.

The reply goes through the same reply parser as a chat completion (reasoning, then tool calls), and the
same builder makes the streamed events and the whole response (responses_output.py).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.chat import ToolSetup
from tandem.frontend.http.chat_prompt import chat_prompt, prompt_ids
from tandem.frontend.http.choices import ChoiceRun
from tandem.frontend.http.errors import APIError
from tandem.frontend.http.reply import ReplyParser
from tandem.frontend.http.response_store import StoredResponse
from tandem.frontend.http.responses_output import ResponseBuilder
from tandem.frontend.http.responses_schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    MessageItem,
    NamedFunctionChoice,
    ResponsesRequest,
)
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


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, InputText))


def _content(content: str | list[Any]) -> str | list[Any]:
    """A message item's content as a chat message's: its text, or its parts where it holds images."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return _text(content)
    parts: list[Any] = []
    for p in content:
        if isinstance(p, InputText):
            parts.append(TextPart(type="text", text=p.text))
        elif p.image_url is None:
            raise APIError(400, "input_image needs an image_url (this server keeps no files)", "input")
        else:
            parts.append(ImageURLPart(type="image_url", image_url=ImageURL(url=p.image_url)))
    return parts


def input_messages(items: str | list[Any]) -> list[ChatMessageBody]:
    """Input items as chat messages: a run of function calls joins the assistant turn before it."""
    if isinstance(items, str):
        return [ChatMessageBody(role="user", content=items)]
    out: list[ChatMessageBody] = []
    for it in items:
        if isinstance(it, MessageItem):
            out.append(ChatMessageBody(role=it.role, content=_content(it.content)))
        elif isinstance(it, FunctionCallItem):
            call = ToolCall(id=it.call_id, function=FunctionCall(name=it.name, arguments=it.arguments))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessageBody(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(it, FunctionCallOutputItem):
            out.append(ChatMessageBody(role="tool", tool_call_id=it.call_id, content=_text(it.output)))
        # A reasoning item is not part of the prompt: templates leave out earlier turns' thinking.
    return out


def _output_message(reply: ReplyParser) -> ChatMessageBody:
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in reply.calls
    ]
    return ChatMessageBody(role="assistant", content=reply.content or None, tool_calls=calls or None,
                       reasoning_content=reply.reasoning)


def _tools(body: ResponsesRequest) -> ToolSetup:
    fns = [
        FunctionDef(name=t.name, description=t.description, parameters=t.parameters) for t in body.tools or []
    ]
    tc = body.tool_choice
    if isinstance(tc, NamedFunctionChoice):
        return ToolSetup(fns, "named", tc.name, body.parallel_tool_calls)
    return ToolSetup(fns, tc, None, body.parallel_tool_calls)


def _params(body: ResponsesRequest, tools: ToolSetup) -> dict[str, Any]:
    p: dict[str, Any] = {
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
    }
    if body.stop is not None:
        p["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        p["json_object"] = True
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema is required with type json_schema", "text.format.schema")
        p["json_schema"] = fmt.schema_
    return with_tools({k: v for k, v in p.items() if v is not None}, tools)


def _head(st: ServerState, body: ResponsesRequest) -> dict[str, Any]:
    """What a response repeats of its request."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": st.model_name,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "metadata": body.metadata or {},
        "tool_choice": body.tool_choice
        if isinstance(body.tool_choice, str)
        else body.tool_choice.model_dump(),
        # The published schema requires a function tool's `strict` and `parameters` (null allowed).
        "tools": [t.model_dump() for t in body.tools or []],
        "text": body.text.model_dump(exclude_none=True, by_alias=True)
        if body.text
        else {"format": {"type": "text"}},
        # The published schema's `user` is a string, not null: left out when not given.
        **({"user": body.user} if body.user is not None else {}),
    }


async def create_response(st: ServerState, body: ResponsesRequest, request: Request) -> Response:
    lora = await st.check_model(body.model)
    history: list[ChatMessageBody] = []
    if body.previous_response_id is not None:
        stored = st.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(
                404,
                f"Previous response with id '{body.previous_response_id}' not found (unknown, "
                f"or dropped: the server keeps the last {st.responses.capacity}).",
                "previous_response_id",
                "previous_response_not_found",
            )
        history = stored.messages
    turn = history + input_messages(body.input)
    system = []
    if body.instructions is not None:
        system = [ChatMessageBody(role="system", content=body.instructions)]
    tools = _tools(body)
    prompt = await chat_prompt(st, system + turn, tools.template_tools(), True, body.chat_template_kwargs)
    ids = prompt_ids(prompt)
    run = ChoiceRun(st.client, st.metrics, [prompt], [_params(body, tools)], body.priority, lora=lora)
    reply = ReplyParser(st.reasoning_parser(ids), tools.parser())
    out = ResponseBuilder(_head(st, body))
    usage = Usage()

    def on(d: CompletionDelta) -> list[dict]:
        usage.add(d, 0)
        events = out.add(reply.add(d))
        if d.finished:
            events += out.finish(reply, _usage(st, usage, reply))
            if body.store:
                st.responses.put(out.head["id"], StoredResponse(turn + [_output_message(reply)], out.body()))
        return events

    if not body.stream:
        async def collect() -> None:
            async for _, d in run:
                on(d)

        await until_disconnect(request, collect())
        return JSONResponse(out.body())

    async def events(deltas: AsyncIterator[tuple[int, CompletionDelta]]) -> AsyncIterator[bytes]:
        for e in out.start():
            yield sse(e, e["type"])
        async for _, d in deltas:
            for e in on(d):
                yield sse(e, e["type"])

    def error_event(err: APIError) -> bytes:
        e = out.event("error", code=err.code, message=err.message, param=None)
        return sse(e, "error")

    return await stream_response(request, run, events, error_event, done=None)


def _usage(st: ServerState, usage: Usage, reply: ReplyParser) -> dict:
    # The reply's text is split, not its tokens: the reasoning's share is its text tokenized again.
    thinking = len(st.tokenizer.encode(reply.reasoning, add_special_tokens=False)) if reply.reasoning else 0
    return {
        "input_tokens": usage.prompt_tokens,
        # Required by the published schema; no prompt-cache writes as OpenAI bills them (Messages says 0 too).
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(thinking, usage.completion_tokens)},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def stored_response(st: ServerState, response_id: str) -> dict:
    stored = st.responses.get(response_id)
    if stored is None:
        raise APIError(
            404, f"Response with id '{response_id}' not found.", "response_id", "response_not_found"
        )
    return stored.body

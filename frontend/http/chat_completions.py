"""POST /v1/chat/completions: messages through the chat template, n choices, tools, SSE or whole.

A choice's text goes through its reply parser (reply.py: reasoning, then tool calls), streamed or not, so
a streamed choice's reasoning, content and call arguments add up to exactly the whole response's.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.chat import chat_tools
from tandem.frontend.http.chat_prompt import chat_prompt, prompt_ids
from tandem.frontend.http.choices import ChoiceRun
from tandem.frontend.http.logprobs import chat_logprobs
from tandem.frontend.http.reply import ReplyDelta, ReplyParser
from tandem.frontend.http.sampling import chat_params, per_choice
from tandem.frontend.http.schemas import ChatCompletionRequest
from tandem.frontend.http.sessions import session_of
from tandem.frontend.http.state import ServerState
from tandem.frontend.http.streaming import sse, stream_response, until_disconnect
from tandem.frontend.http.usage import Usage


class _Choice:
    def __init__(self, index: int, reply: ReplyParser) -> None:
        self.index, self.reply = index, reply
        self.logprobs: list[dict] | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.reply.finish_reason

    @property
    def tool_calls(self) -> list[dict]:
        return [c.message() for c in self.reply.calls]


async def create_chat_completion(st: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    lora = await st.check_model(body.model)
    tools = chat_tools(body)
    prompt = await chat_prompt(st, body.messages, tools.template_tools(), True, body.chat_template_kwargs)
    ids = prompt_ids(prompt)
    params = chat_params(body)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    session = session_of(body, body.n)  # its turn's request id is the response's id
    run = ChoiceRun(st.client, st.metrics, [prompt] * body.n, per_choice(params, body.n), body.priority,
                    session, [cid] if session else None, lora)
    choices = [_Choice(i, ReplyParser(st.reasoning_parser(ids), tools.parser())) for i in range(body.n)]
    usage = Usage()

    def on(d: CompletionDelta, c: _Choice) -> tuple[ReplyDelta, list[dict] | None]:
        lp = chat_logprobs(st, d.logprobs) if body.logprobs and d.logprobs is not None else None
        if lp is not None:
            c.logprobs = (c.logprobs or []) + lp
        usage.add(d, 0)
        return c.reply.add(d), lp

    def head(obj: str) -> dict:
        return {"id": cid, "object": obj, "created": created, "model": st.model_name}

    if not body.stream:
        async def collect() -> None:
            async for i, d in run:
                on(d, choices[i])

        await until_disconnect(request, collect())
        out = []
        for c in choices:
            text = c.reply.content
            msg: dict = {"role": "assistant", "content": text if text or not c.tool_calls else None}
            if st.reasoning is not None:
                msg["reasoning_content"] = c.reply.reasoning
            if c.tool_calls:
                msg["tool_calls"] = c.tool_calls
            out.append({"index": c.index, "message": msg,
                        "logprobs": {"content": c.logprobs or []} if body.logprobs else None,
                        "finish_reason": c.finish_reason})
        return JSONResponse({**head("chat.completion"), "choices": out, "usage": usage.body()})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(c: _Choice, delta: dict, lp: list[dict] | None) -> bytes:
        ch = {"index": c.index, "delta": delta, "logprobs": {"content": lp} if lp is not None else None,
              "finish_reason": c.finish_reason}
        return sse(
            {**head("chat.completion.chunk"), "choices": [ch], **({"usage": None} if include_usage else {})}
        )

    async def chunks(deltas: AsyncIterator[tuple[int, CompletionDelta]]) -> AsyncIterator[bytes]:
        for c in choices:
            yield chunk(c, {"role": "assistant", "content": ""}, None)
        async for i, d in deltas:
            c = choices[i]
            out, lp = on(d, c)
            if out or lp or d.finished:
                delta: dict = {"reasoning_content": out.reasoning} if out.reasoning else {}
                if out.content:
                    delta["content"] = out.content
                if out.tool_calls:
                    delta["tool_calls"] = out.tool_calls
                yield chunk(c, delta, lp)
        if include_usage:
            yield sse({**head("chat.completion.chunk"), "choices": [], "usage": usage.body()})

    return await stream_response(request, run, chunks)

"""POST /v1/chat/completions: messages through the chat template, n choices, tools, SSE or whole.

With tools in play a choice's text goes through its tool-call parser, streamed or not, so a streamed
choice's content and call arguments add up to exactly the whole response's.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from frontend.completion import CompletionDelta
from frontend.http.chat import active_tools, render_chat, tool_call_parser
from frontend.http.choices import ChoiceRun
from frontend.http.logprobs import chat_logprobs
from frontend.http.sampling import chat_params, per_choice
from frontend.http.schemas import ChatCompletionRequest
from frontend.http.sessions import session_of
from frontend.http.state import ServerState
from frontend.http.streaming import sse, stream_response, until_disconnect
from frontend.http.tool_calls import ParsedDelta
from frontend.http.usage import Usage


class _Choice:
    def __init__(self, index: int, body: ChatCompletionRequest) -> None:
        self.index = index
        self.text = ""
        self.logprobs: list[dict] | None = None
        self.finish_reason: str | None = None
        self.parser = tool_call_parser(body)

    def add(self, d: CompletionDelta) -> ParsedDelta:
        """This delta's content and tool-call entries (a text cut off by max_tokens stays "length")."""
        if self.parser is None:
            self.text += d.text
            out = ParsedDelta(d.text)
        else:
            out = self.parser.feed(d.text)
            if d.finished:
                rest = self.parser.finish()
                out = ParsedDelta(out.content + rest.content, out.tool_calls + rest.tool_calls)
            self.text = self.parser.content
        if d.finished:
            self.finish_reason = "length" if d.finish_reason == "length" else "stop"
            if self.tool_calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        return out

    @property
    def tool_calls(self) -> list[dict]:
        return [c.message() for c in self.parser.calls] if self.parser is not None else []


async def create_chat_completion(st: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    st.check_model(body.model)
    tools = active_tools(body)
    ids = render_chat(st.tokenizer, body.messages, tools)
    params = chat_params(body)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    session = session_of(body, body.n)  # its turn's request id is the response's id
    run = ChoiceRun(st.client, st.metrics, [ids] * body.n, per_choice(params, body.n), body.priority, session,
                    [cid] if session else None)
    choices = [_Choice(i, body) for i in range(body.n)]
    usage = Usage()

    def on(d: CompletionDelta, c: _Choice) -> tuple[ParsedDelta, list[dict] | None]:
        lp = chat_logprobs(st, d.logprobs) if body.logprobs and d.logprobs is not None else None
        if lp is not None:
            c.logprobs = (c.logprobs or []) + lp
        usage.add(d, 0)
        return c.add(d), lp

    def head(obj: str) -> dict:
        return {"id": cid, "object": obj, "created": created, "model": st.model_name}

    if not body.stream:
        async def collect() -> None:
            async for i, d in run:
                on(d, choices[i])

        await until_disconnect(request, collect())
        out = []
        for c in choices:
            msg: dict = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None}
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
        return sse({**head("chat.completion.chunk"), "choices": [ch], **({"usage": None} if include_usage else {})})

    async def chunks(deltas: AsyncIterator[tuple[int, CompletionDelta]]) -> AsyncIterator[bytes]:
        for c in choices:
            yield chunk(c, {"role": "assistant", "content": ""}, None)
        async for i, d in deltas:
            c = choices[i]
            out, lp = on(d, c)
            if out or lp or d.finished:
                delta: dict = {"content": out.content} if out.content else {}
                if out.tool_calls:
                    delta["tool_calls"] = out.tool_calls
                yield chunk(c, delta, lp)
        if include_usage:
            yield sse({**head("chat.completion.chunk"), "choices": [], "usage": usage.body()})

    return await stream_response(request, run, chunks)

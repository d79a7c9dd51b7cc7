"""ollama's native API on the one-model server: POST /api/chat, /api/generate, /api/embed, /api/show and
GET /api/tags, /api/ps, /api/version (`add_ollama_routes`).

A translation onto the machinery of the OpenAI routes: messages and tools through the chat template
(chat_prompt_ids), `options` and `format` into SamplingParams (ollama_schema.py; `format` as
response_format's json_object / json_schema), one engine request (ChoiceRun: a client that leaves aborts
it), the reply through the reply parser (reasoning as `thinking`, the model's tool calls as ollama's
`{"function": {"name", "arguments": {...}}}`), embeddings through the /v1/embeddings path. Streams are
NDJSON (one JSON object a line, `done: true` on the last, with the counts and nanosecond durations);
`stream` is true unless the request says false. Errors on /api/* are ollama's `{"error": "..."}`
(errors.py picks the shape by path); an unknown model is a 404 `model 'x' not found`.

Decisions where ollama's API asks for what tandem has not: `images` go to a vision model's processor (a
400 for a text-only model; not with `raw` or `context`, and /api/generate gives no `context` back with them);
`/api/generate`'s `template` (an ollama Go template) is a 400 when given (empty, as ollama's Go client
sends it, is fine), as is `suffix` (no fill-in-the-middle here); `raw` prompts are tokenized as
/v1/completions does (`system` ignored) and answer no `context` (as ollama's); `keep_alive` is taken and
ignored (a router in front acts on it); an empty prompt (or no messages) answers at once with done_reason
"load". A tool call whose arguments never became a whole JSON object (cut off by num_predict) is dropped:
ollama's calls carry an arguments object.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.chat import ToolSetup, chat_prompt_ids
from tandem.frontend.http.chat_prompt import chat_prompt, prompt_ids
from tandem.frontend.http.choices import ChoiceRun
from tandem.frontend.http.embeddings import EmbeddingRequest, create_embedding
from tandem.frontend.http.errors import APIError
from tandem.frontend.http.logprobs import chat_logprobs
from tandem.frontend.http.ollama_models import (
    chat_template,
    never_expires,
    ollama_model_entry,
    ollama_show,
    rfc3339,
)
from tandem.frontend.http.ollama_schema import (
    GenerationBody,
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaShowRequest,
    format_params,
    options_params,
    think_kwargs,
)
from tandem.frontend.http.reply import ReplyParser
from tandem.frontend.http.schemas import (
    ChatMessageBody,
    FunctionCall,
    ImageURL,
    ImageURLPart,
    TextPart,
    ToolCall,
)
from tandem.frontend.http.state import ServerState
from tandem.frontend.http.streaming import stream_response, until_disconnect
from tandem.frontend.http.tool_calls import ParsedToolCall
from tandem.frontend.prompt_tokens import encode_text
from tandem.protocol.final_info import FinalInfo
from tandem.protocol.image_item import ImagePrompt

NDJSON = "application/x-ndjson"
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_WHY = {400: "invalid request", 401: "missing or wrong key", 404: "unknown model",
        413: "request body over --max-request-bytes", 500: "the engine failed the request",
        503: "engine dead, draining or overloaded"}
Shape = Callable[[str, str, list[dict], Any], dict]  # (content, thinking, calls, logprobs) -> fields


def _answers(*statuses: int, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses=` of an ollama route: its errors in ollama's shape; `stream`: NDJSON too."""
    out: dict[int | str, dict[str, Any]] = {
        s: {"description": _WHY[s], "content": {"application/json": {"schema": _ERROR}}} for s in statuses
    }
    if stream:
        out[200] = {"content": {NDJSON: {"schema": {"type": "object"}}}}
    return out


async def check_model(st: ServerState, name: str) -> None:
    """The server's check (`NAME` or `NAME:latest`), its 404 in ollama's words."""
    if not name:
        raise APIError(400, "model is required", "model")
    try:
        await st.check_model(name)
    except APIError as e:
        if e.status != 404:
            raise
        raise APIError(404, f"model '{name}' not found", "model", e.code) from None


def _line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _head(model: str) -> dict:
    return {"model": model, "created_at": rfc3339()}


def _arguments(text: str) -> dict | None:
    """A call's arguments as an object, once whole (also an object written as a JSON string)."""
    try:
        v = json.loads(text)
        if isinstance(v, str):
            v = json.loads(v)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def _ready_calls(calls: list[ParsedToolCall], sent: int, finished: bool) -> tuple[list[dict], int]:
    """The calls after the first `sent` whose arguments are whole, in ollama's shape, and how many calls
    are dealt with now (at the end, one never whole is dropped)."""
    out = []
    while sent < len(calls):
        args = _arguments(calls[sent].arguments)
        if args is None and not finished:
            break
        if args is not None:
            out.append({"function": {"name": calls[sent].name, "arguments": args}})
        sent += 1
    return out, sent


def _stats(final: FinalInfo | None, t0: int) -> dict:
    """The closing object's counts and durations (nanoseconds; the model is always loaded: load 0)."""
    ts = final.time_stats if final else None
    prefill = ts.first_token - ts.first_scheduled if ts and ts.first_token and ts.first_scheduled else 0.0
    return {"done_reason": "length" if final and final.finish_reason == "length" else "stop",
            "total_duration": time.perf_counter_ns() - t0, "load_duration": 0,
            "prompt_eval_count": final.prompt_tokens if final else 0,
            "prompt_eval_duration": int(prefill * 1e9),
            "eval_count": final.completion_tokens if final else 0,
            "eval_duration": int((ts.decode_s if ts else 0.0) * 1e9)}


def _params(body: GenerationBody) -> dict[str, Any]:
    p = {**options_params(body.options), **format_params(body.format)}
    if body.logprobs:
        p["logprobs"] = body.top_logprobs or 0
    return p


async def _respond(st: ServerState, request: Request, body: GenerationBody, prompt: list[int] | ImagePrompt,
                   params: dict, reply: ReplyParser, shape: Shape, end: Callable[[list[int]], dict], t0: int,
                   ) -> Response:
    """Run the prompt; answer one object (stream false) or NDJSON: a piece per delta that says something,
    then the closing object (`end(output ids)` adds to it)."""
    run = ChoiceRun(st.client, st.metrics, [prompt], [params], lora=await st.check_model(body.model))
    want_lp = "logprobs" in params
    out_ids: list[int] = []
    sent = 0  # tool calls dealt with

    def on(d: CompletionDelta) -> tuple[str, str, list[dict], list[dict] | None]:
        nonlocal sent
        out_ids.extend(d.token_ids)
        part = reply.add(d)
        calls, sent = _ready_calls(reply.calls, sent, d.finished)
        lp = chat_logprobs(st, d.logprobs) if want_lp and d.logprobs is not None else None
        return part.content, part.reasoning, calls, lp

    def closing() -> dict:
        return {"done": True, **_stats(reply.final, t0), **end(out_ids)}

    if not body.stream:
        calls: list[dict] = []
        lps: list[dict] = []

        async def collect() -> None:
            async for _, d in run:
                _, _, new, lp = on(d)
                calls.extend(new)
                lps.extend(lp or [])

        await until_disconnect(request, collect())
        whole = shape(reply.content, reply.reasoning or "", calls, lps if want_lp else None)
        return JSONResponse({**_head(body.model), **whole, **closing()})

    async def lines(deltas: AsyncIterator[tuple[int, CompletionDelta]]) -> AsyncIterator[bytes]:
        async for _, d in deltas:
            content, thinking, calls, lp = on(d)
            if content or thinking or calls or lp:
                yield _line({**_head(body.model), **shape(content, thinking, calls, lp), "done": False})
        yield _line({**_head(body.model), **shape("", "", [], None), **closing()})

    response = await stream_response(request, run, lines, lambda e: _line({"error": e.message}), done=None)
    response.media_type = NDJSON
    response.headers["content-type"] = NDJSON
    return response


def _chat_shape(content: str, thinking: str, calls: list[dict], lp: list[dict] | None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        msg["thinking"] = thinking
    if calls:
        msg["tool_calls"] = calls
    return {"message": msg, **({"logprobs": lp} if lp is not None else {})}


def _generate_shape(content: str, thinking: str, calls: list[dict], lp: list[dict] | None) -> dict:
    return {"response": content, **({"thinking": thinking} if thinking else {}),
            **({"logprobs": lp} if lp is not None else {})}


def _loaded(model: str, shape: dict) -> JSONResponse:
    """ollama's answer to a request with nothing to generate: the model is loaded (it always is here)."""
    return JSONResponse({**_head(model), **shape, "done_reason": "load", "done": True})


def ollama_chat_messages(msgs: list[OllamaMessage]) -> list[ChatMessageBody]:
    """ollama's messages as the chat template reads them. A tool result names its function (`tool_name`):
    it answers the latest call of that name not answered yet (its id made up when ollama gave none)."""
    out, pending = [], []
    for i, m in enumerate(msgs):
        calls = [ToolCall(id=c.id or f"call_{i}_{j}", function=FunctionCall(
            name=c.function.name, arguments=json.dumps(c.function.arguments)))
            for j, c in enumerate(m.tool_calls or [])] or None
        if calls:
            pending = list(calls)
        call_id = m.tool_call_id
        if m.role == "tool" and call_id is None and pending:
            match = next((c for c in pending if c.function.name == m.tool_name), pending[0])
            pending.remove(match)
            call_id = match.id
        tool = m.role == "tool"
        content: Any = m.content or ""
        if m.images:  # base64 without a data: head; the images before the text, as ollama's templates do
            content = [ImageURLPart(type="image_url", image_url=ImageURL(url=f"data:image/png;base64,{b}"))
                       for b in m.images] + ([TextPart(type="text", text=m.content)] if m.content else [])
        out.append(ChatMessageBody(
            role=m.role, content=content, tool_calls=calls, name=m.tool_name if tool else None,
            tool_call_id=call_id if tool else None,
            reasoning_content=m.thinking if m.role == "assistant" else None))
    return out


async def ollama_chat(st: ServerState, body: OllamaChatRequest, request: Request) -> Response:
    t0 = time.perf_counter_ns()
    await check_model(st, body.model)
    params = _params(body)
    if not body.messages:
        return _loaded(body.model, {"message": {"role": "assistant", "content": ""}})
    tools = ToolSetup([t.function for t in body.tools or []], "auto", param="tools")
    prompt = await chat_prompt(st, ollama_chat_messages(body.messages), tools.template_tools(), True,
                               think_kwargs(body.think))
    reply = ReplyParser(st.reasoning_parser(prompt_ids(prompt)), tools.parser())
    return await _respond(st, request, body, prompt, params, reply, _chat_shape, lambda _: {}, t0)


def _generate_ids(st: ServerState, body: OllamaGenerateRequest) -> list[int]:
    """The prompt: `context` (an earlier answer's conversation) then the prompt, as it is when raw or the
    model has no chat template, else (with `system`) through the chat template."""
    ctx = list(body.context or [])
    # A model with no chat template (a base model's file) takes the prompt as it is, as ollama's default
    # template (`{{ .Prompt }}`) gives it.
    if body.raw or not chat_template(st.tokenizer):
        return ctx + encode_text(st.tokenizer, body.prompt, add_special_tokens=not ctx)
    msgs = [ChatMessageBody(role="system", content=body.system)] if body.system else []
    new = chat_prompt_ids(st.tokenizer, [*msgs, ChatMessageBody(role="user", content=body.prompt)], None,
                          True, think_kwargs(body.think))
    bos = getattr(st.tokenizer, "bos_token_id", None)
    if ctx and bos is not None and new[:1] == [bos]:
        new = new[1:]  # one beginning of sequence, at the conversation's start
    return ctx + new


async def ollama_generate(st: ServerState, body: OllamaGenerateRequest, request: Request) -> Response:
    t0 = time.perf_counter_ns()
    await check_model(st, body.model)
    params = _params(body)
    if body.images and (body.raw or body.context):
        raise APIError(400, "images go through the chat template: not with raw or context", "images")
    if body.template:
        raise APIError(400, "`template` is not taken here: the prompt goes through the model's own chat "
                       "template (or send a formatted prompt with raw: true)", "template")
    if body.suffix:
        raise APIError(400, f"{body.model} does not support insert (`suffix`)", "suffix")
    bad = [t for t in body.context or [] if t >= st.info.vocab_size]
    if bad:
        raise APIError(400, f"context holds token id {bad[0]}, outside the vocabulary [0, "
                       f"{st.info.vocab_size})", "context")
    if not body.prompt:
        return _loaded(body.model, {"response": ""})
    if body.images:  # a user turn: the images, then the prompt
        msgs = [ChatMessageBody(role="system", content=body.system)] if body.system else []
        parts = [ImageURLPart(type="image_url", image_url=ImageURL(url=f"data:image/png;base64,{b}"))
                 for b in body.images]
        msgs.append(ChatMessageBody(role="user", content=[*parts, TextPart(type="text", text=body.prompt)]))
        prompt: list[int] | ImagePrompt = await chat_prompt(st, msgs, None, True, think_kwargs(body.think))
    else:
        prompt = _generate_ids(st, body)
    ids = prompt_ids(prompt)
    reply = ReplyParser(None if body.raw else st.reasoning_parser(ids), None)

    def end(out: list[int]) -> dict:
        # a context of image tokens would come back without its images: none is given
        return {} if body.raw or body.images else {"context": ids + out}

    return await _respond(st, request, body, prompt, params, reply, _generate_shape, end, t0)


async def ollama_embed(st: ServerState, body: OllamaEmbedRequest, request: Request) -> dict:
    """Through /v1/embeddings' path (its checks and errors). `truncate` (the default) cuts an input past
    the context length to it, as ollama does; without it such an input is the engine's 400."""
    t0 = time.perf_counter_ns()
    await check_model(st, body.model)
    options_params(body.options)  # checked; none of them applies to an embedding
    inputs: list[str] | list[list[int]] = [body.input] if isinstance(body.input, str) else body.input
    if not inputs:
        return {"model": body.model, "embeddings": [], "total_duration": 0, "load_duration": 0,
                "prompt_eval_count": 0}
    limit = st.info.max_model_len
    if body.truncate:
        encoded = [encode_text(st.tokenizer, x) for x in inputs]  # type: ignore[arg-type]
        if any(len(ids) > limit for ids in encoded):
            inputs = [ids[:limit] for ids in encoded]
    out = await create_embedding(
        st, EmbeddingRequest(model=st.model_name, input=inputs, dimensions=body.dimensions), request
    )
    return {"model": body.model, "embeddings": [d["embedding"] for d in out["data"]],
            "total_duration": time.perf_counter_ns() - t0, "load_duration": 0,
            "prompt_eval_count": out["usage"]["prompt_tokens"]}


def add_ollama_routes(app: FastAPI, st: ServerState, authed: list[Any]) -> None:
    generation = _answers(400, 401, 404, 413, 500, 503, stream=True)

    @app.post("/api/chat", dependencies=authed, responses=generation)
    async def api_chat(body: OllamaChatRequest, request: Request) -> Response:
        return await ollama_chat(st, body, request)

    @app.post("/api/generate", dependencies=authed, responses=generation)
    async def api_generate(body: OllamaGenerateRequest, request: Request) -> Response:
        return await ollama_generate(st, body, request)

    @app.post("/api/embed", dependencies=authed, responses=_answers(400, 401, 404, 413, 500, 503))
    async def api_embed(body: OllamaEmbedRequest, request: Request) -> dict:
        return await ollama_embed(st, body, request)

    @app.post("/api/show", dependencies=authed, responses=_answers(400, 401, 404, 413))
    async def api_show(body: OllamaShowRequest) -> dict:
        await check_model(st, body.model or body.name or "")
        return ollama_show(st.model_name, st.model_path, st.info, st.tokenizer, st.reasoning is not None)

    @app.get("/api/tags", dependencies=authed, responses=_answers(401))
    async def api_tags() -> dict:
        return {"models": [ollama_model_entry(st.model_name, st.model_path, st.info, None)]}

    @app.get("/api/ps", dependencies=authed, responses=_answers(401))
    async def api_ps() -> dict:
        return {"models": [ollama_model_entry(st.model_name, st.model_path, st.info, never_expires())]}

    @app.get("/api/version")
    async def api_version() -> dict:
        return {"version": app.version}

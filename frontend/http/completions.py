"""POST /v1/completions: text (or token-id) prompts, n choices each, streamed as SSE or whole."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.choices import ChoiceRun
from tandem.frontend.http.logprobs import CompletionLogprobs
from tandem.frontend.http.sampling import completion_params, per_choice
from tandem.frontend.http.schemas import CompletionRequest
from tandem.frontend.http.sessions import session_of
from tandem.frontend.http.state import ServerState
from tandem.frontend.http.streaming import sse, stream_response, until_disconnect
from tandem.frontend.http.usage import Usage
from tandem.frontend.prompt_tokens import encode_text
from tandem.protocol.errors import ErrorCode, InvalidRequestError


def _prompts(st: ServerState, body: CompletionRequest) -> tuple[list[str | None], list[list[int]]]:
    """(texts, token ids) of each prompt: tokenized here, so that echo and its logprobs know the ids."""
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]  # type: ignore[list-item]
    texts = [x if isinstance(x, str) else None for x in p]
    ids = [encode_text(st.tokenizer, x) if isinstance(x, str) else list(x) for x in p]
    if not ids or not all(ids):  # as the engine says it, before echo reads a first token that is not there
        raise InvalidRequestError("the prompt is empty", ErrorCode.EMPTY_PROMPT)
    return texts, ids


class _Choice:
    def __init__(self, index: int, echo_text: str, lp: CompletionLogprobs | None) -> None:
        self.index, self.lp = index, lp
        self.text = echo_text
        self.finish_reason: str | None = None

    def body(self, text: str) -> dict:
        return {"index": self.index, "text": text, "logprobs": self.lp.body() if self.lp else None,
                "finish_reason": self.finish_reason}


async def create_completion(st: ServerState, body: CompletionRequest, request: Request) -> Response:
    lora = await st.check_model(body.model)
    texts, ids = _prompts(st, body)
    params = completion_params(body)
    n = body.n
    prompts = [pid for pid in ids for _ in range(n)]
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    session = session_of(body, len(prompts))  # its turn's request id is the response's id
    run = ChoiceRun(
        st.client,
        st.metrics,
        prompts,
        [sp for _ in ids for sp in per_choice(params, n)],
        body.priority,
        session,
        [cid] if session else None,
        lora,
    )
    want_lp = body.logprobs is not None
    choices: list[_Choice] = []
    for k in range(len(prompts)):
        echo = (
            (texts[k // n] if texts[k // n] is not None else st.tokenizer.decode(ids[k // n]))
            if body.echo
            else ""
        )
        lp = CompletionLogprobs() if want_lp else None
        if lp is not None and body.echo:
            lp.add_first(st, ids[k // n][0])
        choices.append(_Choice(k, echo, lp))
    usage = Usage()

    def on(d: CompletionDelta, c: _Choice) -> None:
        if c.lp is not None:
            if d.prompt_logprobs is not None:
                c.lp.add(st, d.prompt_logprobs)
            if d.logprobs is not None:
                c.lp.add(st, d.logprobs)
        usage.add(d, c.index // n)
        if d.finished:
            c.finish_reason = "length" if d.finish_reason == "length" else "stop"

    def head() -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": st.model_name}

    if not body.stream:
        async def collect() -> None:
            async for i, d in run:
                c = choices[i]
                on(d, c)
                c.text += d.text

        await until_disconnect(request, collect())
        return JSONResponse({**head(), "choices": [c.body(c.text) for c in choices], "usage": usage.body()})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks(deltas: AsyncIterator[tuple[int, CompletionDelta]]) -> AsyncIterator[bytes]:
        sent_echo = [False] * len(choices)
        async for i, d in deltas:
            c = choices[i]
            mark = len(c.lp.tokens) if c.lp else 0
            on(d, c)
            text = d.text
            if not sent_echo[i]:
                sent_echo[i], text = True, c.text + text
            out = c.body(text)
            if c.lp is not None:
                out["logprobs"] = {k: v[mark:] for k, v in c.lp.body().items()}
            yield sse({**head(), "choices": [out], **({"usage": None} if include_usage else {})})
        if include_usage:
            yield sse({**head(), "choices": [], "usage": usage.body()})

    return await stream_response(request, run, chunks)

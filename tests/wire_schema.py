"""Strict checks of what the server sends against the official SDKs' types (generated from the published
OpenAPI specs). The SDKs parse leniently (model_construct, undeclared keys kept, missing ones tolerated), so a
body the real API would never send still reads fine through them: here the raw JSON is validated (pydantic,
no construct), no key at any depth may be one the type does not declare (the SDK models allow extras, which
land in `model_extra`), every leaf must be the value sent (not a coercion of it), and where OpenAI's
published spec is tighter than its SDK's types (see SPEC_*), the spec holds.

`Recorder` is a transport that keeps every exchange, and `check_exchanges` holds each Responses and
Messages body (whole, every streamed event, errors) to its type: tests hook it in where they talk HTTP.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import anthropic.types as anthropic_types
import httpx2
from openai.types import ErrorObject
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

# Where OpenAI's published spec (github.com/openai/openai-openapi, openapi.json) says more than the SDK's
# types, by SDK class name: keys it requires though they may be null (the SDK reads those as optional),
# keys it never allows to be null (the SDK types them Optional), and keys it declares that the SDK's type
# does not. Only the types this server sends.
SPEC_REQUIRED = {
    "Response": {"error", "incomplete_details", "instructions", "metadata", "temperature", "top_p"},
    "FunctionTool": {"parameters", "strict"},
    "ResponseErrorEvent": {"code", "param"},
    "ErrorObject": {"code", "param"},
}
SPEC_NOT_NULL = {
    "Response": {"user", "text", "status", "usage"},
    "ResponseReasoningItem": {"content", "status"},
    "ResponseFunctionToolCall": {"id", "status"},
    "ResponseOutputText": {"logprobs"},
}
SPEC_ONLY = {"ResponseFunctionCallArgumentsDoneEvent": {"name"}}


@cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


def strict(tp: Any, raw: Any) -> Any:
    """`raw` (parsed JSON) as the SDK type `tp`, or an AssertionError naming every departure from it."""
    value = _adapter(tp).validate_python(raw)  # raises on a missing required field or a wrong type
    wrong: list[str] = []
    _same(value, raw, "$", wrong)
    assert not wrong, "\n".join(wrong)
    return value


def _same(value: Any, raw: Any, path: str, wrong: list[str]) -> None:
    if isinstance(value, BaseModel):
        if not isinstance(raw, dict):
            wrong.append(f"{path}: {raw!r} is not an object")
            return
        cls = type(value).__name__
        extra = sorted(set(value.model_extra or {}) - SPEC_ONLY.get(cls, set()))
        if extra:
            wrong.append(f"{path} ({cls}): keys the schema does not declare: {extra}")
        for name, f in type(value).model_fields.items():
            key = f.alias or name
            if key in raw:
                if raw[key] is None and key in SPEC_NOT_NULL.get(cls, ()):
                    wrong.append(f"{path} ({cls}): {key!r} may not be null")
                _same(getattr(value, name), raw[key], f"{path}.{key}", wrong)
            elif f.is_required() or key in SPEC_REQUIRED.get(cls, ()):
                wrong.append(f"{path} ({cls}): required key {key!r} missing")
    elif isinstance(value, (list, tuple)):
        if not isinstance(raw, list) or len(raw) != len(value):
            wrong.append(f"{path}: {raw!r} is not a list of {len(value)}")
            return
        for i, (v, r) in enumerate(zip(value, raw)):
            _same(v, r, f"{path}[{i}]", wrong)
    elif isinstance(value, dict):
        if not isinstance(raw, dict) or raw.keys() != value.keys():
            wrong.append(f"{path}: {raw!r} is not an object with keys {sorted(value)}")
            return
        for k in value:
            _same(value[k], raw[k], f"{path}.{k}", wrong)
    elif isinstance(value, float) and type(raw) is int:
        if value != raw:  # JSON has one number type: 3 is a valid float
            wrong.append(f"{path}: sent {raw!r}, read as {value!r}")
    elif type(value) is not type(raw) or value != raw:  # pydantic's lax mode would read "3" as 3
        wrong.append(f"{path}: sent {raw!r}, read as {value!r}")


def sse_events(body: str) -> list[tuple[str | None, Any]]:
    """A text/event-stream body as (event name, parsed data), a final `[DONE]` left out."""
    out: list[tuple[str | None, Any]] = []
    for block in body.strip().split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data and data != ["[DONE]"]:
            out.append((name, json.loads("\n".join(data))))
    return out


def strict_events(tp: Any, body: str, error: Any = None) -> list[Any]:
    """Every event of a stream strictly as the event union `tp` (an `error` event as `error` where the
    union has none), its SSE name the same as its `type`."""
    out = []
    for i, (name, data) in enumerate(sse_events(body)):
        assert name == data.get("type"), f"event {i}: {name!r} carries type {data.get('type')!r}"
        try:
            out.append(strict(error if error is not None and name == "error" else tp, data))
        except (AssertionError, ValueError) as e:
            raise AssertionError(f"event {i} ({name}): {e}") from None
    return out


def strict_openai_error(body: Any) -> Any:
    assert isinstance(body, dict) and body.keys() == {"error"}, body
    return strict(ErrorObject, body["error"])


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    content_type: str
    body: bytes


class Recorder(httpx2.AsyncBaseTransport, httpx2.BaseTransport):
    """Wraps a transport; keeps every exchange whole (the body read before the client sees it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.exchanges: list[Exchange] = []

    def _keep(self, request: httpx2.Request, resp: httpx2.Response, body: bytes) -> httpx2.Response:
        self.exchanges.append(Exchange(request.method, request.url.path, resp.status_code,
                                       resp.headers.get("content-type", ""), body))
        headers = [(k, v) for k, v in resp.headers.items() if k.lower() != "content-encoding"]
        return httpx2.Response(resp.status_code, headers=headers, content=body, request=request)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        resp = self.inner.handle_request(request)
        return self._keep(request, resp, resp.read())

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        resp = await self.inner.handle_async_request(request)
        return self._keep(request, resp, await resp.aread())

    def close(self) -> None:
        self.inner.close()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def check(self) -> int:
        """Every Responses and Messages exchange so far held to its type; returns how many there were."""
        n = check_exchanges(self.exchanges)
        self.exchanges.clear()
        return n


def check_exchanges(exchanges: list[Exchange]) -> int:
    n = 0
    for x in exchanges:
        where = f"{x.method} {x.path} -> {x.status}"
        try:
            n += _check(x)
        except (AssertionError, ValueError) as e:
            raise AssertionError(f"{where}:\n{e}") from None
    return n


def _check(x: Exchange) -> int:
    streamed = x.content_type.startswith("text/event-stream")
    text = x.body.decode()
    if re.fullmatch(r"/v1/responses(/[^/]+)?", x.path):
        if x.status >= 400:
            strict_openai_error(json.loads(text))
        elif streamed:
            strict_events(ResponseStreamEvent, text)
        else:
            strict(Response, json.loads(text))
        return 1
    if x.path in ("/v1/messages", "/v1/messages/count_tokens"):
        if x.status >= 400:
            strict(anthropic_types.ErrorResponse, json.loads(text))
        elif streamed:
            strict_events(anthropic_types.RawMessageStreamEvent, text, error=anthropic_types.ErrorResponse)
        elif x.path.endswith("count_tokens"):
            strict(anthropic_types.MessageTokensCount, json.loads(text))
        else:
            strict(anthropic_types.Message, json.loads(text))
        return 1
    return 0  # other routes: not this helper's (chat completions carry tandem's own reasoning_content)

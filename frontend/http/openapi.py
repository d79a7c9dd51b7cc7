"""What the OpenAPI document (`GET /openapi.json`) says each route answers, so that it is true: every error
status a route gives, with its body's schema (OpenAI's error object, or Anthropic's on the Messages API),
the event stream beside JSON where a route streams, and no 422 (validation errors are 400s here).

Each route states its answers beside its decorator (`responses=answers(...)`); `install` drops the 422
FastAPI adds to every route that validates a body."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}
# One server-sent event (OpenAPI 3.1 documents a stream by its event's schema): `data` is a JSON object, or
# `[DONE]` where an OpenAI stream ends; `event` names it on the Responses and Messages APIs.
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "contentMediaType": "application/json"},
        "event": {"type": "string"},
    },
}
_WHY = {400: "invalid request (the field is named)", 401: "missing or wrong key", 404: "unknown model or id",
        409: "a name taken, or a resource busy", 413: "request body over --max-request-bytes",
        500: "the engine failed the request", 503: "engine dead, draining or overloaded"}
# A route that takes a JSON body can always answer these (the door's size limit, a body that is no JSON).
BODY = (400, 413)
ENGINE = (500, 503)  # a route that asks the engine


def answers(*statuses: int, anthropic: bool = False, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: its error statuses with their body schema; `stream`: its 200 may also be
    a `text/event-stream`."""
    schema = _ANTHROPIC_ERROR if anthropic else _OPENAI_ERROR
    out: dict[int | str, dict[str, Any]] = {
        s: {"description": _WHY[s], "content": {"application/json": {"schema": schema}}}
        for s in sorted(set(statuses))
    }
    if stream:
        out[200] = {"content": {"text/event-stream": {"schema": _EVENT}}}
    return out


def install(app: FastAPI, model_names: list[str], vocab_size: int) -> None:
    """`model_names`: what a request's `model` may be (any other is a 404), written into every body's schema;
    `vocab_size`: the bound of every token id (schemas.TokenId)."""
    make = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = make()
            for ops in doc.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for schema in schemas.values():
                _name_models(schema.get("properties", {}).get("model"), model_names)
            _bound_token_ids(schemas, vocab_size)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _name_models(prop: dict[str, Any] | None, names: list[str]) -> None:
    if prop is None:
        return
    for branch in prop.get("anyOf", [prop]):  # an optional model: the string branch of string-or-null
        if branch.get("type") == "string":
            branch["enum"] = list(names)


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    if isinstance(node, dict):
        if node.pop("x-token-id", False):
            node["maximum"] = vocab_size - 1
        for v in node.values():
            _bound_token_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _bound_token_ids(v, vocab_size)

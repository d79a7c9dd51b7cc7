"""An OpenAI request body into tandem's SamplingParams fields (one set per choice)."""
from __future__ import annotations

from typing import Any

from tandem.frontend.http.chat import ToolSetup, chat_tools
from tandem.frontend.http.errors import APIError
from tandem.frontend.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingBody


def _common(body: SamplingBody) -> dict[str, Any]:
    p: dict[str, Any] = {
        "max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "top_k": body.top_k, "min_p": body.min_p, "repetition_penalty": body.repetition_penalty,
        "min_tokens": body.min_tokens, "ignore_eos": body.ignore_eos,
        "regex": body.regex, "choice": body.choice, "grammar": body.grammar,
    }
    if body.stop is not None:
        p["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.stop_token_ids is not None:
        p["stop_token_ids"] = body.stop_token_ids
    if body.seed is not None:
        p["seed"] = body.seed
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        p["json_object"] = True
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format.json_schema is required with type json_schema",
                           "response_format.json_schema")
        p["json_schema"] = rf.json_schema.schema_
    return {k: v for k, v in p.items() if v is not None}


def per_choice(p: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """n parameter sets: a seeded request's choices get seed, seed+1, ... so they differ, reproducibly."""
    if "seed" not in p:
        return [p] * n
    return [{**p, "seed": (p["seed"] + i) % 2**63} for i in range(n)]


def completion_params(body: CompletionRequest) -> dict[str, Any]:
    p = _common(body)
    if body.logprobs is not None:
        p["logprobs"] = body.logprobs
        if body.echo:
            p["prompt_logprobs"] = body.logprobs
    return p


def chat_params(body: ChatCompletionRequest) -> dict[str, Any]:
    p = _common(body)
    if body.max_completion_tokens is not None:
        p["max_tokens"] = body.max_completion_tokens
    if body.logprobs:
        p["logprobs"] = body.top_logprobs or 0
    elif body.top_logprobs is not None:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return with_tools(p, chat_tools(body))


def with_tools(p: dict[str, Any], tools: ToolSetup) -> dict[str, Any]:
    """The parameters with the grammar that forces a tool call, when the tool choice forces one."""
    schema = tools.forced_schema()
    if schema is not None:
        if any(k in p for k in ("json_schema", "json_object", "regex", "grammar", "choice")):
            raise APIError(400, f"a forced {tools.param} cannot be combined with another output constraint",
                           tools.param)
        p["json_schema"] = schema
    return p

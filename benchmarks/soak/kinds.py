"""What the soak sends: prompts, structured-output schemas, and every kind of bad request the validation
knows, each with the error it must get."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tandem.protocol.errors import ErrorCode

WORDS = (
    "the river stone light window morning paper garden silver engine winter music table orange cloud "
    "letter bridge forest quiet number yellow market simple travel mountain story dinner station"
).split()

# Small schemas, compiled once and cached: the structured requests that must succeed.
SCHEMAS: tuple[dict[str, Any], ...] = (
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
)
CHOICES = ["yes", "no", "maybe"]
# Compile cost per pattern property per vocabulary entry, measured here (xgrammar 0.2.9: 0.145 s a property
# at SmolLM2's 49,152 tokens, 4 ms at 1,024): the slow grammar is sized from it to take SLOW_FACTOR times the
# compile timeout, at most SLOW_MAX_PROPS properties (a small vocabulary would need thousands).
COMPILE_S_PER_PROP_TOKEN = 3e-6
SLOW_FACTOR = 5.0
SLOW_MAX_PROPS = 200


@dataclass(frozen=True)
class Shape:
    """What the soak knows of the engine under test."""

    model: str  # the served model name (HTTP)
    vocab: int
    context: int
    token_ids: tuple[int, ...]  # ids a prompt may hold
    max_request_bytes: int
    grammar_timeout_s: float


def text_prompt(rng: random.Random, lo: int = 4, hi: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def end_is_sound(reason: str | None, tokens: int, max_tokens: int) -> bool:
    """A "length" end is exactly max_tokens tokens; a "stop" end at most that many."""
    return (reason == "length" and tokens == max_tokens) or (reason == "stop" and tokens <= max_tokens)


def id_prompt(rng: random.Random, shape: Shape, lo: int = 8, hi: int = 400) -> list[int]:
    return [rng.choice(shape.token_ids) for _ in range(rng.randint(lo, hi))]


def slow_schema(shape: Shape, tag: int) -> dict[str, Any]:
    """A distinct schema (never cached) whose compilation outlasts the engine's grammar timeout."""
    target = SLOW_FACTOR * shape.grammar_timeout_s
    props = min(SLOW_MAX_PROPS, max(8, int(target / (COMPILE_S_PER_PROP_TOKEN * shape.vocab))))
    return {"type": "object", "properties": {f"p{tag}_{i}": {"type": "string", "pattern": "[a-z]{1,50}"}
                                             for i in range(props)}}


def bad_zmq(shape: Shape) -> list[tuple[str, Any, dict[str, Any], str]]:
    """(name, prompt, params, the error code) for the Python client; the frontend refuses each."""
    too_long = [shape.token_ids[0]] * shape.context
    return [
        ("temperature", "hi", {"temperature": -1.0}, ErrorCode.PARAMS),
        ("top_k_zero", "hi", {"top_k": 0}, ErrorCode.PARAMS),
        ("unknown_field", "hi", {"nucleus": 0.5}, ErrorCode.PARAMS),
        ("two_constraints", "hi", {"regex": "a+", "choice": ["a"]}, ErrorCode.PARAMS),
        ("min_over_max", "hi", {"max_tokens": 2, "min_tokens": 5}, ErrorCode.PARAMS),
        ("logprobs_over", "hi", {"logprobs": 50}, ErrorCode.PARAMS),
        ("too_many_stops", "hi", {"stop": ["x"] * 20}, ErrorCode.PARAMS),
        ("empty_prompt", [], {}, ErrorCode.EMPTY_PROMPT),
        ("token_id", [shape.vocab + 5], {}, ErrorCode.TOKEN_ID),
        ("stop_token_id", "hi", {"stop_token_ids": [shape.vocab + 1]}, ErrorCode.TOKEN_ID),
        ("prompt_too_long", too_long, {}, ErrorCode.PROMPT_TOO_LONG),
        (
            "prompt_plus_max_tokens",
            [shape.token_ids[0]] * 8,
            {"max_tokens": shape.context},
            ErrorCode.PROMPT_TOO_LONG,
        ),
    ]


def bad_http(shape: Shape) -> list[tuple[str, bytes | dict[str, Any], int, str | None]]:
    """(name, body, status, error code or None for any) for POST /v1/completions."""
    m = shape.model
    return [
        ("unknown_model", {"model": "no-such-model", "prompt": "hi"}, 404, "model_not_found"),
        ("bad_json", b'{"model": "x", "prompt": ', 400, None),
        ("temperature", {"model": m, "prompt": "hi", "temperature": 9}, 400, "invalid_value"),
        ("missing_prompt", {"model": m}, 400, "invalid_value"),
        ("n_zero", {"model": m, "prompt": "hi", "n": 0}, 400, "invalid_value"),
        ("token_id", {"model": m, "prompt": [shape.vocab + 5]}, 400, ErrorCode.TOKEN_ID),
        ("prompt_too_long", {"model": m, "prompt": [shape.token_ids[0]] * shape.context}, 400,
         ErrorCode.PROMPT_TOO_LONG),
        ("top_k_zero", {"model": m, "prompt": "hi", "top_k": 0}, 400, ErrorCode.PARAMS),
    ]

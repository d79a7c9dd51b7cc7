"""Structured output through the whole stack (xgrammar): JSON schemas, regex, EBNF, choice; forward
early, sample late with async scheduling on and off; free requests unaffected by constrained ones."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tandem import InvalidRequestError, SamplingParams
from tests.conftest import check_idle_engine


class Address(BaseModel):
    city: str = Field(max_length=6)
    zip: int = Field(ge=10000, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=8)
    address: Address


SCHEMAS = [
    Person.model_json_schema(),  # a Pydantic model's schema, passed as is
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "string", "enum": ["S", "M", "L"]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": -5, "maximum": 100},
                                      "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["count", "ratio"], "additionalProperties": False},
    {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 6},
                                      "note": {"type": "string", "maxLength": 4}},
     "required": ["greeting", "note"], "additionalProperties": False},
]


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.fixture(scope="module")
def engines(tiny_model, request):
    from tandem import Client

    out = {}
    for mode in (True, False):
        # float32 as conftest's launch_client pins it: the free requests' tokens are compared across batch
        # shapes, which --dtype auto's bf16 on AMX / AVX512-BF16 CPUs does not keep bit for bit.
        c = Client.launch(str(tiny_model("llama")), kv_cache_tokens=32768, async_scheduling=mode,
                          max_running_requests=128, dtype="float32")
        request.addfinalizer(c.close)
        out[mode] = c
    return out


@pytest.mark.parametrize("mode", [True, False], ids=["async", "sync"])
def test_json_schemas_200_requests_validate(engines, mode: bool) -> None:
    client = engines[mode]
    prompts, params, schemas = [], [], []
    for i in range(200):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append([3 + i % 50, 7, 9])
        params.append(SamplingParams(max_tokens=160, temperature=1.0, seed=i, json_schema=schema))
        schemas.append(schema)
    outs = client.generate_batch(prompts, params, progress=False)
    valid = sum(_valid(o.text, s) for o, s in zip(outs, schemas))
    assert all(o.finish_reason == "stop" for o in outs), [
        o.finish_reason for o in outs if o.finish_reason != "stop"
    ]
    assert valid == 200, f"{valid}/200 valid"
    check_idle_engine(client)


STRICT_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "city": {"enum": ["東京", "café", "naïve 😀"]},
        },
        "required": ["name", "city"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 2},
        "minItems": 1,
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "boolean"}},
                    "required": ["k", "v"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["rows"],
        "additionalProperties": False,
    },
    {"type": "string", "minLength": 2, "maxLength": 12},
]


def test_400_length_bounded_unicode_outputs_parse_strictly(engines) -> None:
    """Random weights at temperature 1 reach every corner of the grammars: raw control characters in
    length-bounded strings (xgrammar#800) and encoded surrogates would both show here."""
    client = engines[True]
    prompts = [[3 + i % 97, 11, 5 + i % 13] for i in range(400)]
    schemas = [STRICT_SCHEMAS[i % len(STRICT_SCHEMAS)] for i in range(400)]
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=1000 + i, json_schema=s)
              for i, s in enumerate(schemas)]
    outs = client.generate_batch(prompts, params, progress=False)
    assert [o.finish_reason for o in outs] == ["stop"] * 400
    bad = [(o.text, s) for o, s in zip(outs, schemas) if not _valid(o.text, s)]
    assert not bad, bad[:3]
    assert sum(any(ord(c) > 127 for c in o.text) for o in outs) > 40  # unicode was exercised
    check_idle_engine(client)


def test_regex_ebnf_and_choice_hold(engines) -> None:
    client = engines[True]
    cases = [
        (
            SamplingParams(max_tokens=64, regex=r"[a-z]{2,5}-\d{3}", seed=1),
            lambda t: re.fullmatch(r"[a-z]{2,5}-\d{3}", t),
        ),
        (
            SamplingParams(
                max_tokens=64, grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?', seed=2
            ),
            lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t),
        ),
        (
            SamplingParams(max_tokens=64, choice=["yes", "no", "東京 🗼"], seed=3),
            lambda t: t in ("yes", "no", "東京 🗼"),
        ),
    ]
    for sp, ok in cases:
        for k in range(5):
            sp2 = SamplingParams(
                **{**{f: getattr(sp, f) for f in sp.__struct_fields__}, "seed": 100 * k + (sp.seed or 0)}
            )
            out = client.generate([11, 12, 13], sp2)
            assert out.finish_reason == "stop" and ok(out.text), (sp2, out.text)
    # Any JSON: unbounded, so a random-weight model may run out of tokens mid-string; whatever ends
    # by the grammar's own termination must parse, and most runs must end that way.
    ended = 0
    for k in range(8):
        out = client.generate([11, 12, 13], SamplingParams(max_tokens=256, json_object=True, seed=k))
        if out.finish_reason == "stop":
            ended += 1
            assert isinstance(json.loads(out.text), (dict, list)), out.text
    assert ended >= 4, f"only {ended}/8 any-JSON outputs terminated"
    check_idle_engine(client)


def test_free_requests_unchanged_by_constrained_neighbours(engines) -> None:
    client = engines[True]
    free = [[20 + i, 21, 22, 23] for i in range(6)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in client.generate_batch(free, greedy, progress=False)]
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=9, json_schema=SCHEMAS[2])
    mixed = client.generate_batch(free + [[5, 6]] * 6, [greedy] * 6 + [constrained] * 6, progress=False)
    assert [o.token_ids for o in mixed[:6]] == alone
    assert all(_valid(o.text, SCHEMAS[2]) for o in mixed[6:])
    check_idle_engine(client)


@pytest.mark.parametrize("bad", [
    {"json_schema": "{not json"},
    {"json_schema": {"type": "no-such-type"}},
    {"regex": "(unclosed"},
    {"grammar": "root ::= missing_rule"},
    {"regex": "a", "choice": ["b"]},
])
def test_invalid_grammar_is_a_typed_error_and_engine_keeps_serving(engines, bad: dict) -> None:
    client = engines[True]
    with pytest.raises(InvalidRequestError):
        client.generate([1, 2, 3], {"max_tokens": 8, **bad})
    assert client.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)).completion_tokens == 3

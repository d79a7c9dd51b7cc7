"""Structured output is always valid JSON: length-bounded strings are rewritten around xgrammar#800, and
the UTF-8 guard keeps encoded surrogates (and any other invalid bytes) out of constrained output."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.scheduler.grammar import GrammarCompilerService, GrammarSpec, allocate_bitmask
from tandem.scheduler.schema_rewrite import rewrite_schema_text
from tandem.scheduler.utf8_guard import ACCEPT, NUM_STATES, REJECT, Utf8Guard, advance
from tests.test_grammar import allowed_ids, model_dir, service, tokenizer  # noqa: F401 - fixtures shared


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _valid_utf8_prefix(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"  # only an incomplete last character


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=12) | st.text(max_size=4).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_automaton_agrees_with_the_decoder(data: bytes) -> None:
    state = advance(ACCEPT, data)
    assert (state != REJECT) == _valid_utf8_prefix(data)
    if state != REJECT:  # on a character boundary exactly when the bytes decode whole
        assert (state == ACCEPT) == _valid_utf8(data)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=5) | st.text(max_size=3).map(str.encode), min_size=1, max_size=70))
def test_guard_masks_are_the_automaton(tokens: list[bytes]) -> None:
    guard = Utf8Guard(tokens, len(tokens) + 5)  # the ids past the tokens have no bytes
    for s in range(NUM_STATES):
        bits = [(int(guard.masks[s, t // 32]) >> (t % 32)) & 1 for t in range(len(tokens))]
        assert bits == [int(advance(s, data) != REJECT) for data in tokens]


def test_surrogate_encodings_rejected() -> None:
    assert advance(ACCEPT, "\ud800".encode("utf-8", "surrogatepass")) == REJECT
    assert advance(ACCEPT, b"\xed\x9f\xbf") == ACCEPT  # U+D7FF, just below the surrogates
    assert advance(ACCEPT, "日本".encode()[:4]) not in (ACCEPT, REJECT)


def test_rewrite_touches_only_length_bounded_strings() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 3},
            "b": {"type": "string", "minLength": 1, "pattern": "^x+$"},
            "c": {"type": "array", "items": {"type": "string", "minLength": 2}},
            "d": {"enum": [{"type": "string", "maxLength": 1}]},  # data, not a schema
        },
    }
    out = json.loads(rewrite_schema_text(json.dumps(schema)))
    assert "maxLength" not in out["properties"]["a"] and out["properties"]["a"]["pattern"].endswith("{0,3}$")
    assert out["properties"]["b"] == schema["properties"]["b"]
    assert out["properties"]["c"]["items"]["pattern"].endswith("{2,}$")
    assert out["properties"]["d"] == schema["properties"]["d"]
    assert rewrite_schema_text("{not json") == "{not json"


def test_bounded_string_counts_characters_and_admits_no_raw_controls(
    service: GrammarCompilerService, tokenizer  # noqa: F811
) -> None:
    g = service.matcher(
        service.compile(GrammarSpec.from_fields(json_schema={"type": "string", "maxLength": 2}))
    )

    def accepts(text: str) -> bool:
        g.reset()
        return all(g.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and g.is_completed()

    assert accepts('"日本"') and accepts('""')
    assert not accepts('"日本語"')
    assert not accepts('"a\x01"')  # a raw control character is not JSON


SCHEMAS = [
    {"type": "string", "minLength": 1, "maxLength": 6},
    {"type": "array", "items": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
     "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "bio": {"type": "string"}},
     "required": ["name", "bio"], "additionalProperties": False},
]


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_walks_are_strict_json_and_valid_utf8(service: GrammarCompilerService, k: int) -> None:  # noqa: F811
    """Random walks over every allowed token (the free strings reach CJK, emoji and partial bytes)."""
    schema = SCHEMAS[k]
    g0 = service.compile(GrammarSpec.from_fields(json_schema=schema))
    raw = service.tokenizer_info.decoded_vocab
    # Past step 60 a walk closes what it opened (a free string ends only by luck): every walk ends.
    closers = {t for t, b in enumerate(raw) if b and set(b) <= set(b'"]}')}
    bitmask = allocate_bitmask(1, service.vocab_size)
    for seed in range(25):
        g, rng, out = service.matcher(g0), random.Random(seed), b""
        for step in range(300):
            g.fill_bitmask(bitmask, 0)
            allowed = allowed_ids(bitmask, 0, service.vocab_size)
            stops = [t for t in allowed if t in g.stop_token_ids]
            closing = [t for t in allowed if t in closers] if step > 60 else []
            if stops and (step > 60 or rng.random() < 0.3):
                tok = stops[0]
            else:
                tok = rng.choice(closing or allowed)
            assert g.accept(tok)
            if g.is_terminated():
                break
            out += raw[tok]
        else:
            raise AssertionError(f"schema {k} walk {seed} did not end in 300 tokens: {out[-80:]!r}")
        jsonschema.validate(json.loads(out.decode("utf-8")), schema)  # strict: raises on bad bytes or JSON

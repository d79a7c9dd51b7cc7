"""scheduler/grammar.py: constraints compiled with xgrammar against the tiny model's byte-level BPE tokenizer,
driven by random walks over the allowed tokens; every terminated walk must satisfy its constraint."""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch

from tandem.protocol.model_info import read_model_info
from tandem.scheduler.grammar import (
    GrammarCompilerService,
    GrammarError,
    GrammarSpec,
    RequestGrammar,
    allocate_bitmask,
)

PAD = 37  # model vocab past the tokenizer (not a multiple of 32): those ids must never be allowed


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def service(model_dir: Path, tokenizer) -> GrammarCompilerService:
    info = read_model_info(model_dir)
    svc = GrammarCompilerService(
        str(model_dir), info.vocab_size + PAD, stop_token_ids=info.eos_token_ids, tokenizer=tokenizer
    )
    yield svc
    svc.shutdown()


def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


class Walker:
    """Random walks: a uniformly random allowed token each step. Stop tokens are taken with some
    probability when allowed; after `soft_cap` steps closing tokens ("]})) are preferred so unbounded
    languages (any JSON, nested parens) still end."""

    def __init__(self, service: GrammarCompilerService, tokenizer) -> None:
        self.service = service
        self.tokenizer = tokenizer
        self.vocab = service.vocab_size
        n_tok = len(tokenizer)
        self.stops = set(service.tokenizer_info.stop_token_ids)
        self.specials = set(tokenizer.all_special_ids) - self.stops
        texts = [tokenizer.decode([i]) for i in range(n_tok)]
        self.closers = {
            i for i, t in enumerate(texts) if t and set(t) <= set('"]})') and i not in self.specials
        }
        self.n_tok = n_tok

    def walk(self, spec: GrammarSpec, seed: int, cap: int = 600, soft_cap: int = 80) -> str:
        g = self.service.matcher(self.service.compile(spec, timeout=60))
        bitmask = allocate_bitmask(1, self.vocab)
        rng = random.Random(seed)
        out: list[int] = []
        for step in range(cap):
            g.fill_bitmask(bitmask, 0)
            allowed = allowed_ids(bitmask, 0, self.vocab)
            assert allowed, "dead end: no token allowed"
            assert max(allowed) < self.n_tok, "an id past the tokenizer was allowed"
            assert not self.specials & set(allowed), "a special (non-stop) token was allowed"
            stops = [t for t in allowed if t in self.stops]
            closers = [t for t in allowed if t in self.closers]
            if stops and (step >= soft_cap or rng.random() < 0.3):
                tok = rng.choice(stops)
            elif step >= soft_cap and closers:
                tok = rng.choice(closers)
            else:
                tok = rng.choice(allowed)
            assert g.accept(tok)
            if g.is_terminated():
                assert tok in self.stops
                assert g.num_accepted == len(out) + 1
                return self.tokenizer.decode(
                    out, skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
            assert tok not in self.stops, "a stop token was accepted without terminating"
            out.append(tok)
        raise AssertionError(f"no termination within {cap} tokens: {self.tokenizer.decode(out)!r}")


@pytest.fixture(scope="module")
def walker(service: GrammarCompilerService, tokenizer) -> Walker:
    return Walker(service, tokenizer)


SEEDS = range(4)

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},  # free text: random tokens include CJK/emoji bytes
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["α", "日本語", "emoji 😀", "plain", 'q"uote']},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "ok": {"type": "boolean"}},
                    "required": ["lat", "ok"],
                },
            },
            "required": ["city", "zip", "geo"],
        },
        "kind": {"enum": ["café", 3, None]},
        "matrix": {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "score", "tags", "address", "kind", "matrix"],
}


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_walks_validate(walker: Walker, seed: int) -> None:
    spec = GrammarSpec.from_fields(json_schema=json.dumps(NESTED_SCHEMA, ensure_ascii=False))
    text = walker.walk(spec, seed)
    jsonschema.validate(json.loads(text), NESTED_SCHEMA)


def test_json_schema_as_dict_and_unicode_strings(walker: Walker) -> None:
    schema = {
        "type": "array",
        "items": {"type": "string", "minLength": 2, "maxLength": 6},
        "minItems": 3,
        "maxItems": 3,
    }
    spec = GrammarSpec.from_fields(json_schema=schema)
    assert spec is not None and spec.kind == "json_schema"
    saw_non_ascii = False
    for seed in range(6):
        value = json.loads(walker.walk(spec, seed))
        jsonschema.validate(value, schema)
        saw_non_ascii |= any(ord(c) > 127 for s in value for c in s)
    assert saw_non_ascii, "random walks over a byte-level vocab should produce some non-ASCII text"


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_walks_parse(walker: Walker, seed: int) -> None:
    text = walker.walk(GrammarSpec.from_fields(json_object=True), seed)
    assert isinstance(
        json.loads(text), (dict, list)
    )  # xgrammar's builtin JSON: an object or array at the top


REGEXES = [
    r"[a-z]{1,6}@(example|test)\.(com|org)",
    r"(héllo|日本語|😀+) [0-9]{2,4}",
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walks_fullmatch(walker: Walker, pattern: str) -> None:
    for seed in SEEDS:
        text = walker.walk(GrammarSpec.from_fields(regex=pattern), seed)
        assert re.fullmatch(pattern, text), (pattern, text)


# Sums and products of positive integers with parentheses: context-free, checked by a small parser.
ARITH = r"""
root ::= expr
expr ::= term (("+" | "*") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]*
"""


def _parses_arith(s: str) -> bool:
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(s) and s[pos] in "+*":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        m = re.compile(r"[1-9][0-9]*").match(s, pos)
        if not m:
            return False
        pos = m.end()
        return True

    return expr() and pos == len(s)


def test_ebnf_walks_parse(walker: Walker) -> None:
    assert _parses_arith("(1+23)*4") and not _parses_arith("(1+)") and not _parses_arith("01")
    spec = GrammarSpec.from_fields(grammar=ARITH)
    texts = [walker.walk(spec, seed) for seed in range(6)]
    for text in texts:
        assert _parses_arith(text), text


CHOICES = ["yes", "no", "yes!", 'say "hi"', "back\\slash", "ünïcödé 日本", "tab\there", "", "😀"]


def test_choice_walks_are_members(walker: Walker) -> None:
    spec = GrammarSpec.from_fields(choice=CHOICES)
    seen = {walker.walk(spec, seed) for seed in range(16)}
    assert seen <= set(CHOICES), seen - set(CHOICES)
    assert len(seen) > 2


def test_choice_forced_text(service: GrammarCompilerService, tokenizer) -> None:
    # Each choice is reachable by its own tokenization (escaping kept the strings exact).
    g = service.matcher(service.compile(GrammarSpec.from_fields(choice=CHOICES)))
    for c in CHOICES:
        assert g.replay(tokenizer.encode(c)), c
        assert g.is_completed(), c
    assert not g.replay(tokenizer.encode("maybe"))


# -- spec --------------------------------------------------------------------------------------------


def test_spec_from_params() -> None:
    from tandem.protocol.sampling_params import SamplingParams

    assert GrammarSpec.from_params(SamplingParams()) is None
    assert GrammarSpec.from_params(SamplingParams(regex="a+")) == GrammarSpec("regex", "a+")
    assert GrammarSpec.from_params(SamplingParams(json_object=True)).key == ("json_object", "")
    assert GrammarSpec.from_params(SamplingParams(choice=["a", "b"])).choices() == ["a", "b"]
    assert GrammarSpec.from_fields(json_schema={"type": "integer"}).text == '{"type": "integer"}'
    with pytest.raises(GrammarError, match="at most one"):
        GrammarSpec.from_fields(regex="a", grammar='root ::= "a"')


# -- compile cache and errors --------------------------------------------------------------------------


def test_cache_compiles_once(model_dir: Path, tokenizer) -> None:
    svc = GrammarCompilerService(str(model_dir), 1024, max_workers=2, tokenizer=tokenizer, cache_size=2)
    try:
        spec = GrammarSpec.from_fields(regex="[0-9]{3}")
        futures: list = []
        barrier = threading.Barrier(4)

        def submit() -> None:
            barrier.wait()
            futures.append(svc.submit(spec))

        threads = [threading.Thread(target=submit) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(f) for f in futures}) == 1  # concurrent requests share one future
        first = futures[0].result(timeout=30)
        assert svc.compile(GrammarSpec("regex", "[0-9]{3}")) is first
        assert svc.num_compiled == 1
        # Defaults: the engine's EOS set (config + generation_config) ends outputs; vocab from the grammar.
        assert svc.tokenizer_info.stop_token_ids == read_model_info(model_dir).eos_token_ids == [0, 2]
        assert RequestGrammar(first).vocab_size == 1024

        # LRU of 2: two other specs push it out, after which it compiles again.
        svc.compile(GrammarSpec.from_fields(regex="a"))
        svc.compile(GrammarSpec.from_fields(regex="b"))
        assert svc.compile(spec) is not first
        assert svc.num_compiled == 4
    finally:
        svc.shutdown()


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"json_schema": '{"type": "foo"}'}, "invalid json_schema.*foo"),
        ({"json_schema": "{not json"}, "invalid json_schema"),
        (
            {"json_schema": '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'},
            "invalid json_schema",
        ),
        ({"regex": "(ab"}, "invalid regex.*parenthesis"),
        ({"regex": r"(a)\1"}, "invalid regex.*[Bb]ackreference"),
        ({"grammar": "root ::= foo"}, "invalid grammar.*foo"),
        ({"grammar": 'start ::= "a"'}, "invalid grammar.*root"),
        ({"choice": []}, "at least one"),
    ],
)
def test_invalid_constraints_raise(service: GrammarCompilerService, fields: dict, match: str) -> None:
    spec = GrammarSpec.from_fields(**fields)
    fut = service.submit(spec)
    with pytest.raises(GrammarError, match=match) as info:
        fut.result(timeout=30)
    assert "/project/cpp" not in str(info.value)  # the C++ location prefix is stripped
    assert service.submit(spec) is fut  # a bad constraint fails the same way: the failure is cached


# -- matcher ---------------------------------------------------------------------------------------------


def _mask(g: RequestGrammar, vocab: int) -> torch.Tensor:
    bm = allocate_bitmask(1, vocab)
    g.fill_bitmask(bm, 0)
    return bm[0].clone()


def test_reject_token_outside_mask(service: GrammarCompilerService, tokenizer) -> None:
    vocab = service.vocab_size
    g = service.matcher(service.compile(GrammarSpec.from_fields(regex="[0-9]+")))
    before = _mask(g, vocab)
    allowed = set(allowed_ids(before.unsqueeze(0), 0, vocab))
    banned = next(t for t in tokenizer.encode("hello world") if t not in allowed)
    assert not g.accept(banned)
    assert not g.accept(1)  # <|im_start|>: special, never text
    assert not g.accept(vocab - 1) and not g.accept(vocab) and not g.accept(-1)
    assert g.num_accepted == 0 and torch.equal(_mask(g, vocab), before)  # a rejection changes nothing

    assert g.replay(tokenizer.encode("42"))
    eos = service.tokenizer_info.stop_token_ids[0]
    assert g.accept(eos) and g.is_terminated()
    assert not g.accept(eos)  # nothing after termination
    # Terminated: the row allows only the stop tokens (xgrammar itself would raise).
    assert allowed_ids(_mask(g, vocab).unsqueeze(0), 0, vocab) == sorted(
        service.tokenizer_info.stop_token_ids
    )


def test_rollback_and_replay_restore_state(service: GrammarCompilerService, tokenizer) -> None:
    vocab = service.vocab_size
    schema = {
        "type": "object",
        "properties": {"k": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["k", "n"],
    }
    g = service.matcher(service.compile(GrammarSpec.from_fields(json_schema=schema)))
    tokens = tokenizer.encode('{"k": "日本 text", "n": 12}')
    masks = [_mask(g, vocab)]
    for t in tokens:
        assert g.accept(t)
        masks.append(_mask(g, vocab))
    assert g.is_completed() and not g.is_terminated()
    assert len({m.numpy().tobytes() for m in masks}) > 3  # the masks really differ along the way

    g.rollback(3)
    assert g.num_accepted == len(tokens) - 3 and torch.equal(_mask(g, vocab), masks[-4])
    with pytest.raises(ValueError):
        g.rollback(len(tokens))
    assert g.replay(tokens) and torch.equal(_mask(g, vocab), masks[-1])
    assert g.num_accepted == len(tokens)

    # Rolling back the stop token un-terminates.
    eos = service.tokenizer_info.stop_token_ids[0]
    assert g.accept(eos) and g.is_terminated()
    g.rollback(1)
    assert not g.is_terminated() and torch.equal(_mask(g, vocab), masks[-1])

    g.reset()
    assert g.num_accepted == 0 and torch.equal(_mask(g, vocab), masks[0])
    assert not g.replay([tokens[0], tokens[0]])  # '{' '{' is not JSON


def test_bitmask_layout(service: GrammarCompilerService, tokenizer) -> None:
    import xgrammar as xgr

    vocab = service.vocab_size
    bm = allocate_bitmask(3, vocab)
    assert bm.dtype == torch.int32 and bm.shape == (3, (vocab + 31) // 32)
    assert torch.equal(bm, xgr.allocate_token_bitmask(3, vocab))
    g = service.matcher(service.compile(GrammarSpec.from_fields(choice=["a"])))
    g.fill_bitmask(bm, 1)  # one row of a batch; the others untouched
    assert (bm[0] == -1).all() and (bm[2] == -1).all()
    assert allowed_ids(bm, 1, vocab) == tokenizer.encode("a")

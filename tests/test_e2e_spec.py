"""Speculative decoding through the whole stack: with --speculative-method ngram, greedy outputs are
token for token those of speculation off (async on and off, stop strings and max_tokens inside
accepted runs, aborts in flight, KV pressure with retraction), and constrained requests stay valid and
unchanged.

Two models: the seeded tiny llama (its attention matters, so wrong KV after a rollback would show;
its outputs rarely repeat, so most drafts are rejected) and a copy with every attention output
projection zeroed (a bigram model: greedy outputs fall into short cycles, so most drafts are accepted
and runs end inside accepted spans)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jsonschema
import pytest
from safetensors.torch import load_file, save_file

from tandem import SamplingParams
from tests.conftest import check_idle_engine
from tests.test_e2e_parity import prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory) -> dict[str, Path]:
    base = tiny_model("llama")
    loopy = tmp_path_factory.mktemp("spec") / "loopy"
    shutil.copytree(base, loopy)
    for f in loopy.glob("*.safetensors"):
        w = load_file(f)
        save_file({k: v * 0 if "o_proj" in k else v for k, v in w.items()}, f, metadata={"format": "pt"})
    return {"attn": base, "loopy": loopy}


@pytest.fixture(scope="module")
def engines(models, request):
    """(model, mode) -> a client; mode: off, async or sync (speculation on)."""
    from tandem import Client

    made: dict = {}

    def get(model: str, mode: str, **opts: object):
        key = (model, mode, tuple(sorted(opts.items())))
        if key not in made:
            spec = {} if mode == "off" else SPEC
            c = Client.launch(
                str(models[model]),
                dtype="float32",
                kv_cache_tokens=opts.pop("kv", 8192),
                max_running_requests=64,
                async_scheduling=mode != "sync",
                **spec,
                **opts,
            )
            request.addfinalizer(c.close)
            made[key] = c
        return made[key]

    return get


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_greedy_equals_off_on_the_parity_prompts(engines, mode: str) -> None:
    ps = prompts(1000)[::3] + [p * 3 for p in prompts(1000, seed=4)[2:5]]  # some repeat themselves
    params = SamplingParams(max_tokens=24, **GREEDY)
    want = [o.token_ids for o in engines("attn", "off").generate_batch(ps, params, progress=False)]
    on = engines("attn", mode)
    got = on.generate_batch(ps, params, progress=False)
    assert [o.token_ids for o in got] == want
    st = on.stats()
    assert st.spec_draft_tokens > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    check_idle_engine(on)


@pytest.mark.slow  # ~9 s: the fast tier (`make test`) keeps under its 10 minutes
def test_runs_end_inside_accepted_spans_like_off(engines) -> None:
    off, on = engines("loopy", "off"), engines("loopy", "async")
    rng = random.Random(3)
    ps = [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    before = on.stats().spec_accepted_tokens
    accepted = 0
    for max_tokens in (1, 7, 29, 63):
        params = SamplingParams(max_tokens=max_tokens, **GREEDY)
        want = off.generate_batch(ps, params, progress=False)
        got = on.generate_batch(ps, params, progress=False)
        assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
        accepted += sum(o.spec_accepted_tokens for o in got)
    # Stop strings and stop tokens from inside the (cycling) output, with the text after them dropped.
    full = off.generate_batch(ps, SamplingParams(max_tokens=48, **GREEDY), progress=False)
    for i, (p, f) in enumerate(zip(ps, full)):
        k = rng.randrange(30, 48)
        stop = f.text[len(f.text) * 3 // 4 :][:3]  # late: in the cycle, where runs are accepted
        cases = [
            SamplingParams(max_tokens=48, stop_token_ids=[f.token_ids[k]], **GREEDY),
            SamplingParams(max_tokens=48, stop=[stop], include_stop_str_in_output=bool(i % 2), **GREEDY),
        ]
        for sp in cases:
            w, g = off.generate(p, sp), on.generate(p, sp)
            assert (g.token_ids, g.text, g.finish_reason, g.matched_stop) == (
                w.token_ids, w.text, w.finish_reason, w.matched_stop
            )
            accepted += g.spec_accepted_tokens
    st = on.stats()
    assert st.spec_accepted_tokens - before == accepted  # each output carries its own share
    # In a cycle every draft is right: whole runs of K were accepted, so ends fell inside them.
    assert st.spec_accepted_per_position[-1] >= 10
    assert len(st.spec_accepted_per_position) == SPEC["num_speculative_tokens"]
    assert st.spec_accepted_per_position == sorted(st.spec_accepted_per_position, reverse=True)
    # The engine totals ride with the outputs (the HTTP server's /metrics reads them there).
    last = list(on.stream(ps[0], SamplingParams(max_tokens=20, **GREEDY)))[-1]
    st = on.stats()
    assert last.load is not None
    assert (
        last.load.spec_draft_tokens,
        last.load.spec_accepted_tokens,
        last.load.spec_accepted_per_position,
    ) == (st.spec_draft_tokens, st.spec_accepted_tokens, st.spec_accepted_per_position)
    assert 0 < last.load.spec_num_drafts <= st.spec_draft_tokens
    check_idle_engine(on)


@pytest.mark.parametrize("model", ["attn", "loopy"])
def test_aborts_in_flight(engines, model: str) -> None:
    on = engines(model, "async")
    params = SamplingParams(max_tokens=60, **GREEDY)
    for stop_after in (1, 3):
        streams = [on.stream([7, 8, 9 + i], params) for i in range(4)]
        for s in streams:
            for _ in range(stop_after):
                next(s)
        for s in streams[::2]:
            s.close()  # closing a stream aborts its request
        for s in streams[1::2]:
            assert sum(len(d.token_ids) for d in s) > 0
    check_idle_engine(on)
    want = engines(model, "off").generate([7, 8, 9], SamplingParams(max_tokens=30, **GREEDY)).token_ids
    assert on.generate([7, 8, 9], SamplingParams(max_tokens=30, **GREEDY)).token_ids == want


def test_kv_pressure_with_retraction_equals_off(engines) -> None:
    rng = random.Random(11)
    ps = [[rng.randrange(3, 1000) for _ in range(rng.randrange(20, 60))] for _ in range(12)]
    params = SamplingParams(max_tokens=30, **GREEDY)
    want = [o.token_ids for o in engines("attn", "off").generate_batch(ps, params, progress=False)]
    tight = engines("attn", "async", kv=200)
    got = [o.token_ids for o in tight.generate_batch(ps, params, progress=False)]
    assert got == want
    st = tight.stats()
    assert st.retractions > 0 and st.spec_draft_tokens > 0
    check_idle_engine(tight)


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"], "additionalProperties": False}


def test_constrained_requests_valid_and_unchanged(engines) -> None:
    """Constrained requests are never speculated, but share steps with requests that are: their grammar
    masks must land on their own logits rows, between the draft rows of the others."""
    free = [[20 + i, 21, 22, 23] for i in range(3)]
    long_greedy = SamplingParams(max_tokens=1500, **GREEDY)  # far longer than the constrained batch
    constrained = [[5, 6, i] for i in range(4)]
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, json_schema=SCHEMA) for i in range(4)]
    want = [o.token_ids for o in engines("attn", "off").generate_batch(constrained, params, progress=False)]
    on = engines("attn", "async")
    streams = [on.stream(p, long_greedy) for p in free]
    for s in streams:
        next(s)  # the free requests are decoding, with drafts
    got = on.generate_batch(constrained, params, progress=False)
    assert on.stats().running >= 1  # a speculating request ran beside the constrained ones throughout
    for s in streams:
        s.close()  # aborts it
    assert [o.token_ids for o in got] == want
    for o in got:
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.spec_accepted_tokens == 0  # constrained requests are never speculated
    check_idle_engine(on)

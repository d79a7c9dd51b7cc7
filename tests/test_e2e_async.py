"""Async scheduling (a step queued while the previous one runs) gives the same outputs as synchronous
scheduling: greedy parity prompts, seeded sampling, stop strings, aborts, under KV pressure."""
from __future__ import annotations

import random

import pytest

from tandem import SamplingParams
from tests.conftest import check_idle_engine
from tests.reference import assert_equal_or_near_tie

LENGTHS = [1, 3, 8, 21, 55, 120, 200, 333]


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    for n in LENGTHS * 3:
        prompts.append([rng.randrange(3, vocab) for _ in range(n)])
    for i in range(len(prompts)):
        kind = i % 3
        if kind == 0:
            params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        elif kind == 1:
            params.append(
                SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
            )
        else:
            params.append(SamplingParams(max_tokens=1 + i % 5, temperature=0.0, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def engines(tiny_model, request):
    from tandem import Client

    model = tiny_model("llama")
    prompts, _ = _workload(1000)
    need = sum(len(p) + 24 for p in prompts)
    out = {}
    for mode in (True, False):
        c = Client.launch(
            str(model),
            dtype="float32",
            kv_cache_tokens=need // 3,
            async_scheduling=mode,
            debug_integrity=True,
            max_num_batched_tokens=256,
        )
        request.addfinalizer(c.close)
        out[mode] = c
    return model, out


def test_async_equals_sync_under_kv_pressure(engines) -> None:
    model, clients = engines
    prompts, params = _workload(1000)
    results = {mode: c.generate_batch(prompts, params, progress=False) for mode, c in clients.items()}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        a, s = results[True][i], results[False][i]
        assert a.finish_reason == s.finish_reason == "length"
        assert len(a.token_ids) == len(s.token_ids) == sp.max_tokens
        if sp.temperature == 0.0:
            assert_equal_or_near_tie(model, p, a.token_ids, s.token_ids)
        else:
            assert a.token_ids == s.token_ids, f"seeded request {i} differs"
    assert any(c.stats().retractions > 0 for c in clients.values())
    for c in clients.values():
        check_idle_engine(c)


def test_async_equals_sync_stop_strings_and_stop_tokens(engines) -> None:
    _, clients = engines
    prompt = [9, 8, 7, 6, 5]
    full = clients[False].generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop_tok = full.token_ids[6]
    stop_str = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    for sp in (
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_str]),
    ):
        a, s = (clients[m].generate(prompt, sp) for m in (True, False))
        assert (a.token_ids, a.text, a.finish_reason, a.matched_stop) == (
            s.token_ids, s.text, s.finish_reason, s.matched_stop)
        assert a.finish_reason == "stop"
    for c in clients.values():
        check_idle_engine(c)


def test_async_abort_with_a_step_in_flight(engines) -> None:
    _, clients = engines
    for c in clients.values():
        for k in range(5):
            stream = c.stream(
                [1, 2, 3 + k], SamplingParams(max_tokens=500, ignore_eos=True), request_id=f"ab{k}"
            )
            got = [next(stream) for _ in range(1 + k)]
            c.abort(f"ab{k}")
            rest = list(stream)
            ends = [d for d in got + rest if d.finished]
            assert len(ends) == 1 and ends[0].finish_reason == "abort"
        check_idle_engine(c)

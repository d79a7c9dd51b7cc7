"""Tensor parallelism on CPU (gloo): TP=2 gives the TP=1 greedy tokens through the whole stack, also for
a model with fewer KV heads than ranks; a dead rank stops the engine and waiting clients get an error."""
from __future__ import annotations

import random

import pytest

from protocol import SamplingParams
from tests.conftest import check_idle_engine
from tests.test_e2e_scheduling import _assert_equal_or_near_tie
from tests.test_lifecycle import assert_killing_stops_engine


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("qwen3", {"num_kv_heads": 1})],
                         ids=["llama", "qwen2", "qwen3", "qwen3-1kv"])
def test_tp2_equals_tp1(arch: str, kw: dict, tiny_model, launch_client) -> None:
    model = tiny_model(arch, **kw)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 5, 17, 64, 150, 333)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    one = [o.token_ids for o in launch_client(model).generate_batch(prompts, params, progress=False)]
    tp2 = launch_client(model, tp_size=2)
    two = [o.token_ids for o in tp2.generate_batch(prompts, params, progress=False)]
    for p, a, b in zip(prompts, two, one):
        _assert_equal_or_near_tie(model, p, a, b)
    check_idle_engine(tp2)


def test_killing_rank_1_stops_the_engine(tiny_model) -> None:
    assert_killing_stops_engine(tiny_model("llama"), "tandem-worker1", "--tp-size", "2")

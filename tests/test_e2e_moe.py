"""MoE models through the whole multi-process stack against transformers' greedy tokens: top-k 1, 2 and 8,
tied and untied, a shared expert, one KV head; async scheduling on and off, prefills chunked by small step
budgets, prefix-cache hits, and tensor parallelism (TP=2, one KV head for two ranks) on CPU (gloo). (The CPU
step graph takes GGUF models only: tests/test_gguf_moe.py runs MoE files through it in the engine.)"""
from __future__ import annotations

import random

import pytest

from tandem import SamplingParams
from tests.conftest import check_idle_engine
from tests.reference import assert_greedy_parity, assert_parity_floor, greedy

LENGTHS = [1, 2, 5, 13, 34, 89, 150, 300]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

# name -> (arch, make_model arguments, engine options): each a different top-k, tying, step budget (64 and
# 128 tokens chunk the longer prompts; 2048 takes them whole) and async mode.
CONFIGS = {
    "qwen3_moe-k2": ("qwen3_moe", {}, {"max_num_batched_tokens": 128, "async_scheduling": True}),
    "qwen3_moe-k8-tied": ("qwen3_moe", {"experts_per_tok": 8, "tie_embeddings": True},
                          {"max_num_batched_tokens": 2048, "async_scheduling": False}),
    "mixtral-k1-kv1": ("mixtral", {"experts_per_tok": 1, "num_kv_heads": 1},
                       {"max_num_batched_tokens": 64, "async_scheduling": False}),
    "qwen2_moe-shared": ("qwen2_moe", {}, {"max_num_batched_tokens": 128, "async_scheduling": True}),
}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_concurrent_greedy_parity_with_transformers(name: str, tiny_model, launch_client) -> None:
    arch, make, opts = CONFIGS[name]
    model = tiny_model(arch, **make)
    client = launch_client(model, debug_integrity=True, **opts)
    ps = _prompts(seed=len(name))
    outs = client.generate_batch(ps, GREEDY, progress=False)
    equal = 0
    for p, out in zip(ps, outs):
        assert out.finish_reason == "length" and out.completion_tokens == MAX_TOKENS
        equal += assert_greedy_parity(
            out.token_ids, greedy(model, p, MAX_TOKENS), f"{name} prompt len {len(p)}"
        )
    assert equal >= len(ps) - 1, f"only {equal}/{len(ps)} sequences equal"
    check_idle_engine(client)


def test_prefix_cache_hits_prefill_only_the_suffix(tiny_model, launch_client) -> None:
    model = tiny_model("qwen3_moe")
    rng = random.Random(6)
    system = [rng.randrange(3, 1000) for _ in range(160)]
    a, b = system + [7, 8, 9], system + [11, 12, 13, 14]
    client = launch_client(model, debug_integrity=True, max_num_batched_tokens=64)
    first = client.generate(a, GREEDY).token_ids
    before = client.stats().prefill_tokens
    second = client.generate(b, GREEDY).token_ids
    # the shared 160 came from the cache
    assert client.stats().prefill_tokens - before == len(b) - len(system)
    assert_parity_floor([(first, greedy(model, a, MAX_TOKENS), "first"),
                         (second, greedy(model, b, MAX_TOKENS), "second, on a cached prefix")], max_detours=0)
    assert client.generate(a, GREEDY).token_ids == first  # a full hit: all but the last token cached
    check_idle_engine(client)


@pytest.mark.parametrize(("arch", "make"), [("qwen3_moe", {}), ("mixtral", {"num_kv_heads": 1})],
                         ids=["qwen3_moe", "mixtral-kv1"])
def test_tp2_gives_transformers_greedy_tokens(arch: str, make: dict, tiny_model, launch_client) -> None:
    """Each rank a slice of every expert; TP=1 is held to transformers above, TP=2 to the same reference."""
    model = tiny_model(arch, **make)
    ps = _prompts(seed=4)[::2]
    client = launch_client(model, tp_size=2, max_num_batched_tokens=128)
    outs = client.generate_batch(ps, GREEDY, progress=False)
    assert_parity_floor([(o.token_ids, greedy(model, p, MAX_TOKENS), f"{arch} TP=2 len {len(p)}")
                         for p, o in zip(ps, outs, strict=True)], max_detours=1)
    check_idle_engine(client)

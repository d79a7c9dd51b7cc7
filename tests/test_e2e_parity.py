"""The whole multi-process stack against transformers: greedy tokens equal, for every architecture."""
from __future__ import annotations

import random

import pytest

from tandem import SamplingParams
from tests.conftest import ARCHS, check_idle_engine
from tests.reference import NEAR_TIE_BF16, NEAR_TIE_BF16_KV, NEAR_TIE_KV_F16, assert_greedy_parity, greedy

LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 150, 200, 256, 300, 333]
MAX_TOKENS = 32
# Different per-step budgets: one arch runs chunked prefills beside decodes, one all-in-one steps.
BUDGETS = {"llama": 128, "qwen2": 2048, "qwen3": 512}


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_greedy_parity_with_transformers(arch: str, tiny_model, launch_client) -> None:
    model = tiny_model(arch)
    client = launch_client(model, max_num_batched_tokens=BUDGETS[arch])
    ps = prompts(1000)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = client.generate_batch(ps, params, progress=False)
    equal = 0
    for p, out in zip(ps, outs):
        assert out.finish_reason == "length"
        assert out.completion_tokens == MAX_TOKENS and out.prompt_tokens == len(p)
        equal += assert_greedy_parity(
            out.token_ids, greedy(model, p, MAX_TOKENS), f"{arch} prompt len {len(p)}"
        )
    # Near-ties are rare with these decisive models; most sequences must match in full.
    assert equal >= len(ps) - 2, f"only {equal}/{len(ps)} sequences equal"
    check_idle_engine(client)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bf16_greedy_parity_with_transformers_bf16(backend: str, tiny_model, launch_client) -> None:
    """bf16 (what --dtype auto picks on AMX / AVX512-BF16 CPUs and on CUDA) against transformers in bf16,
    with the near-tie rule at bf16's tolerance; both CPU attention backends."""
    import torch

    model = tiny_model("llama")
    client = launch_client(model, dtype="bfloat16", attention_backend=backend)
    ps = prompts(1000, seed=5)[::3]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = client.generate_batch(ps, params, progress=False)
    equal = sum(
        assert_greedy_parity(
            o.token_ids, greedy(model, p, 16, torch.bfloat16), f"bf16 len {len(p)}", NEAR_TIE_BF16
        )
        for p, o in zip(ps, outs)
    )
    # Tiny random models have many bf16-sized gaps: 4 of 6 match in full on an AMX CPU (a detour each in the
    # other two, at gaps below the measured tolerance), the floor.
    assert equal >= len(ps) - 2, f"only {equal}/{len(ps)} sequences equal"
    check_idle_engine(client)


@pytest.mark.parametrize(
    ("kv_dtype", "backend"),
    [("float16", "cpu"), ("float16", "torch"), ("bfloat16", "cpu")],
    ids=["f16-cpu", "f16-torch", "bf16-cpu"],
)
def test_half_kv_greedy_parity_with_transformers_fp32(kv_dtype: str, backend: str, tiny_model,
                                                      launch_client) -> None:
    """A float32 model over a float16 or bfloat16 KV pool (--kv-cache-dtype) against transformers in float32,
    with the near-tie rule at the pool's measured tolerance (tests/reference.py: NEAR_TIE_KV_F16,
    NEAR_TIE_BF16_KV): the C kernel over the half pool, and the torch path."""
    model = tiny_model("qwen3")  # qk-norm'd K: a different K scale than llama's
    client = launch_client(model, kv_cache_dtype=kv_dtype, attention_backend=backend)
    ps = prompts(1000, seed=9)[::2]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = client.generate_batch(ps, params, progress=False)
    near_tie = NEAR_TIE_KV_F16 if kv_dtype == "float16" else NEAR_TIE_BF16_KV
    equal = sum(assert_greedy_parity(o.token_ids, greedy(model, p, MAX_TOKENS), f"{kv_dtype} KV len {len(p)}",
                                     near_tie) for p, o in zip(ps, outs))
    assert equal >= len(ps) - 2, f"only {equal}/{len(ps)} sequences equal"
    check_idle_engine(client)


def test_request_arriving_mid_decode_equals_alone(tiny_model, launch_client) -> None:
    model = tiny_model("llama")
    client = launch_client(model)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    late = prompts(1000, seed=7)[10]
    alone = client.generate(late, params).token_ids
    background = [client.stream(p, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
                  for p in prompts(1000, seed=3)[:6]]
    for g in background:
        next(g)  # each background request is decoding
    joined = client.generate(late, params).token_ids
    for g in background:
        for _ in g:
            pass
    assert joined == alone
    check_idle_engine(client)

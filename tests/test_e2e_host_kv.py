"""The host KV tier and logprob_start_len through the whole stack, with a real (tiny) model: multi-turn
conversations on a device pool of 1/8 of their KV give the outputs of a large pool, loading their history
back from the host tier; prompt logprobs served partly from the prefix cache equal those without it."""
from __future__ import annotations

import random

from tandem import SamplingParams
from tests.conftest import check_idle_engine
from tests.reference import assert_equal_or_near_tie, assert_parity_floor, greedy

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _conversations(client, turns: int, n_conv: int, user: int, out: int) -> list[list[int]]:
    rng = random.Random(3)
    hist: list[list[int]] = [[] for _ in range(n_conv)]
    answers = []
    for _ in range(turns):
        prompts = [h + [rng.randrange(3, 1000) for _ in range(user)] for h in hist]
        done = client.generate_batch(prompts, SamplingParams(max_tokens=out, **GREEDY), progress=False)
        for c, (p, d) in enumerate(zip(prompts, done)):
            answers.append((p, d.token_ids))
            hist[c] = p + d.token_ids
    return answers


def test_small_device_pool_with_host_tier_matches_a_large_pool(tiny_model, launch_client) -> None:
    model = tiny_model("llama")
    shape = dict(turns=3, n_conv=8, user=40, out=8)  # 8 x 144 tokens of KV in the end
    large = launch_client(model, kv_cache_tokens=4096)
    want = _conversations(large, **shape)
    tiered = launch_client(
        model, kv_cache_tokens=8 * 144 // 8 + 16, host_kv_tokens=4096, debug_integrity=True
    )
    got = _conversations(tiered, **shape)
    parted: set[int] = set()  # conversations whose history took the other side of a near-tie
    for turn, ((p, w), (q, g)) in enumerate(zip(want, got)):
        what = f"turn {turn // 8} conversation {turn % 8}"
        if p == q:
            assert_equal_or_near_tie(model, p, g, w, what)
        else:  # an earlier answer took the other side of a near-tie: this history is held to the reference
            parted.add(turn % 8)
            assert_parity_floor([(g, greedy(model, q, len(w)), what)], max_detours=1)
    assert len(parted) <= 1, f"{len(parted)} of 8 conversations parted at a near-tie"
    st = tiered.stats()
    assert st.host_hit_tokens > 0, "later turns should have loaded their history from the host tier"
    assert st.host_kv_pool_size == 4096 and 0 < st.host_kv_used <= 4096
    check_idle_engine(tiered)


def test_prompt_logprobs_from_a_start_use_the_cache_and_equal_no_cache(tiny_model, launch_client) -> None:
    model = tiny_model("qwen2")
    rng = random.Random(8)
    prompt = [rng.randrange(3, 1000) for _ in range(48)]
    start = 30
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, logprob_start_len=start, **GREEDY)
    cached = launch_client(model, debug_integrity=True)
    cached.generate(prompt + [5], SamplingParams(max_tokens=2, **GREEDY))  # earlier traffic: the prefix
    before = cached.stats().prefill_tokens
    hit = cached.generate(prompt, params)
    assert cached.stats().prefill_tokens - before == len(prompt) - (start - 1), (
        "the cache served start-1 tokens"
    )
    full = cached.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY))
    check_idle_engine(cached)

    plain = launch_client(model, prefix_cache=False)
    ref = plain.generate(prompt, params)
    lp, want = hit.prompt_logprobs, ref.prompt_logprobs
    assert lp is not None and want is not None
    assert lp.token_ids == want.token_ids == prompt[start:]
    assert max(abs(a - b) for a, b in zip(lp.logprobs, want.logprobs)) < 1e-4
    for a, b in zip(lp.top_logprobs, want.top_logprobs):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    # Without a start, every prompt token but the first gets its logprob (the cache serves none of them).
    assert full.prompt_logprobs is not None and full.prompt_logprobs.token_ids == prompt[1:]
    tail = full.prompt_logprobs.logprobs[start - 1 :]
    assert max(abs(a - b) for a, b in zip(tail, want.logprobs)) < 1e-4
    check_idle_engine(plain)

"""Gemma 3's sliding-window layers beside the engine's other features, end to end against transformers:
n-gram speculation (drafts verified over the sliding layers' own pool, the case of the bug fixed in
3d72530, guarded before only by the fake worker), sessions (turns continued from the KV a session holds,
a branch included) and the host KV tier (which shares one pool between the layers). Every sequence is
transformers' greedy continuation, at most one near-tie detour per run."""

from __future__ import annotations

import random

from tandem import SamplingParams
from tests.conftest import check_idle_engine
from tests.reference import assert_parity_floor, greedy

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
WINDOW = 16  # make_model's tiny Gemma 3


def _repetitive(seed: int) -> list[list[int]]:
    """Prompts that repeat a chunk (the n-gram drafter's case), from under one window to several."""
    rng = random.Random(seed)
    out = []
    for chunk, times, tail in ((6, 3, 2), (10, 4, 5), (14, 5, 9), (20, 6, 3)):
        piece = [rng.randrange(3, 1000) for _ in range(chunk)]
        out.append(piece * times + [rng.randrange(3, 1000) for _ in range(tail)])
    return out


def test_speculation_over_the_sliding_pool(tiny_model, launch_client) -> None:
    model = tiny_model("gemma3")
    client = launch_client(model, speculative_method="ngram", num_speculative_tokens=4, debug_integrity=True)
    ps = _repetitive(seed=1)
    outs = client.generate_batch(ps, GREEDY, progress=False)
    st = client.stats()
    assert st.spec_draft_tokens > 0 and st.swa_kv_pool_size > 0  # drafted, with the sliding layers' own pool
    assert_parity_floor([(o.token_ids, greedy(model, p, MAX_TOKENS), f"spec len {len(p)}")
                         for p, o in zip(ps, outs, strict=True)], max_detours=1)
    check_idle_engine(client)


def test_session_turns_and_a_branch_over_the_sliding_pool(tiny_model, launch_client) -> None:
    model = tiny_model("gemma3")
    client = launch_client(model, debug_integrity=True)
    rng = random.Random(5)
    runs = []
    rids: list[str] = []
    turns: list[list[int]] = []  # each turn's whole context before its output
    context: list[int] = []
    with client.open_session(capacity_tokens=400, timeout_s=120) as session:
        for k in range(4):  # each turn past another window
            new = [rng.randrange(3, 1000) for _ in range(WINDOW + 3)]
            c = session.generate(new, GREEDY)
            if k:
                assert c.prefix_source == "session"
            whole = context + new
            runs.append((c.token_ids, greedy(model, whole, MAX_TOKENS), f"turn {k}"))
            turns.append(whole)
            rids.append(c.request_id)
            context = whole + c.token_ids
        branch = session.generate([7, 8, 9], GREEDY, branch_from=rids[1])
        whole = turns[1] + runs[1][0] + [7, 8, 9]
        runs.append((branch.token_ids, greedy(model, whole, MAX_TOKENS), "branch from turn 1"))
    assert_parity_floor(runs, max_detours=1)
    check_idle_engine(client)


def test_host_tier_reloads_with_sliding_layers(tiny_model, launch_client) -> None:
    model = tiny_model("gemma3")
    rng = random.Random(9)
    system = [rng.randrange(3, 1000) for _ in range(60)]
    first = [system + [rng.randrange(3, 1000) for _ in range(5)] for _ in range(3)]
    # a pool too small to keep the shared prefix beside the filler: it is evicted to the host and reloaded
    client = launch_client(model, kv_cache_tokens=256, host_kv_tokens=2048, debug_integrity=True)
    outs = client.generate_batch(first, GREEDY, progress=False)
    filler = [[rng.randrange(3, 1000) for _ in range(100)] for _ in range(4)]
    client.generate_batch(filler, SamplingParams(max_tokens=2), progress=False)
    later = [system + [rng.randrange(3, 1000) for _ in range(7)] for _ in range(2)]
    outs += client.generate_batch(later, GREEDY, progress=False)
    assert client.stats().host_hit_tokens > 0, "the shared prefix should come back from the host tier"
    assert_parity_floor([(o.token_ids, greedy(model, p, MAX_TOKENS), f"host tier len {len(p)}")
                         for p, o in zip(first + later, outs, strict=True)], max_detours=1)
    check_idle_engine(client)

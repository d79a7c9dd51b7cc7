"""The sliding-window layers' own KV pool in the scheduler (scheduler/hybrid_allocator.py, kv_cache.py): as a
request grows, the sliding KV every window has left behind goes back to the pool, and what a query's window
reads is always still there and its own (a fake worker checks every key of every window, as the fake worker
checks the full slots); prefix-cache hits start only where the window before them is held; retraction
under a short sliding pool loses nothing; the allocator's invariants catch a broken map."""
from __future__ import annotations

import random

import pytest

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import ModelRunnerOutput, SchedulerOutput
from tandem.protocol.model_info import ModelInfo
from tandem.scheduler.hybrid_allocator import HybridAllocator
from tandem.scheduler.scheduler import Scheduler
from tests.fake_worker import VOCAB, FakeWorker, expected_output
from tests.test_scheduler_core import req, run

WINDOW = 16


class WindowWorker(FakeWorker):
    """The fake worker with a sliding pool: each computed position's KV (the fake worker's hash of its prefix,
    draft tokens included) is also written to its sliding slot, and every query checks that each key its
    window reads holds there what the key's full slot holds (which the fake worker checks is right)."""

    def __init__(self, num_slots: int, swa_slots: int, window: int, drafter=None, k: int = 0) -> None:
        super().__init__(num_slots, **({"drafter": drafter} if drafter else {}), k=k)
        self.window, self.swa_slots = window, swa_slots
        self.swa_map: dict[int, int] = {}
        self.swa_content: dict[int, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for s in so.scheduled:
            assert len(s.swa_slots) == len(s.slots), "every slot comes with its sliding slot"
            self.swa_map.update(zip(s.slots, s.swa_slots, strict=True))
        computed = {**self.computed, **{r.req_pool_idx: r.num_cached for r in so.new_reqs}}
        spans = {}  # row -> the positions this step computes (drafts the proposer did not match: none)
        for s in so.scheduled:
            row = s.req_pool_idx
            drafts = (
                len(self.drafts.get(row, [])[: s.num_drafts])
                if row not in {r.req_pool_idx for r in so.new_reqs}
                else 0
            )
            spans[row] = (computed[row], computed[row] + s.num_tokens - (s.num_drafts - drafts))
        out = super().execute(so)
        for row, (start, end) in spans.items():
            kv = self.kv[row]
            for pos in range(start, end):
                swa = self.swa_map[kv[pos]]
                assert 1 <= swa <= self.swa_slots, f"row {row} position {pos}: no sliding slot to write"
                self.swa_content[swa] = self.slot_content[kv[pos]]
            for q in range(start, end):
                for key in range(max(0, q - self.window + 1), q + 1):
                    got = self.swa_content.get(self.swa_map.get(kv[key], 0))
                    assert got == self.slot_content[kv[key]], (
                        f"row {row} query {q}: key {key}'s sliding KV is gone or another's")
        return out


def make(slots: int = 4096, swa: int = 1024, depth: int = 2, budget: int = 64, max_running: int = 16,
         page: int = 1, chunk: int | None = None, cache: bool = True, spec: int = 0,
         drafter=None) -> tuple[Scheduler, WindowWorker]:
    cfg = EngineConfig(model="x", max_num_batched_tokens=budget, max_running_requests=max_running,
                       async_scheduling=depth == 2, page_size=page, chunked_prefill_tokens=chunk,
                       prefix_cache=cache, debug_integrity=True, speculative_method="ngram" if spec else None,
                       num_speculative_tokens=spec or 4)
    info = ModelInfo(vocab_size=VOCAB, max_model_len=2048, eos_token_ids=[0], architecture="fake",
                     sliding_window=WINDOW)
    worker = WindowWorker(slots + page - 1, swa + page - 1, WINDOW, drafter, spec)
    return Scheduler(cfg, info, slots, num_swa_slots=swa), worker


def held(sched: Scheduler) -> int:
    hybrid = sched.kv.hybrid
    assert hybrid is not None
    return hybrid.swa.size - hybrid.swa.num_free


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_long_request_holds_about_one_window_of_sliding_kv(depth: int, page: int) -> None:
    sched, worker = make(depth=depth, page=page, budget=32)
    prompt = list(range(1, 301))
    sched.add_request(req("a", prompt, max_tokens=60))
    most = []
    outputs, ends = run(sched, worker, depth, on_step=lambda _: most.append(held(sched)))
    assert outputs["a"] == expected_output(prompt, 60) and ends["a"][0] == "length"
    # A chunk of 32 beside a window of 16 (the slots of the step in flight, a partial page): never the 360.
    assert max(most) <= 32 * depth + WINDOW + 2 * page, max(most)
    # Finished: the cache keeps every full slot, the sliding KV of its last window only.
    assert sched.kv.tree.evictable_size == 359 // page * page
    assert held(sched) <= WINDOW + page


@pytest.mark.parametrize("depth", [1, 2])
def test_a_cached_prefix_serves_only_where_the_window_before_it_is_held(depth: int) -> None:
    sched, worker = make(depth=depth)
    base = list(range(1, 201))
    sched.add_request(req("a", base, max_tokens=20))
    run(sched, worker, depth)
    a_len = 200 + 20 - 1  # what A cached: its prompt and all but the last output (computed, committed)
    # B continues A's conversation: A's tail still has its sliding KV, so B starts right after it.
    b_prompt = base + expected_output(base, 20)[:19] + [7, 8, 9]
    sched.add_request(req("b", b_prompt, max_tokens=5))
    outs, _ = run(sched, worker, depth)
    assert sched.reqs == {} and outs["b"] == expected_output(b_prompt, 5)
    assert [r.num_cached for so in worker.steps for r in so.new_reqs][-1] == a_len
    # C shares only A's first 100 tokens: their sliding KV is long gone, so C computes from the start.
    c_prompt = base[:100] + [5, 5, 5]
    sched.add_request(req("c", c_prompt, max_tokens=5))
    outs, _ = run(sched, worker, depth)
    assert outs["c"] == expected_output(c_prompt, 5)
    assert [r.num_cached for so in worker.steps for r in so.new_reqs][-1] == 0


def test_retraction_under_a_short_sliding_pool_loses_nothing() -> None:
    rng = random.Random(1)
    # 8 short prompts are all admitted, then each grows to a window of sliding KV: 8 windows do not fit
    # 100 sliding slots, so some are retracted, and resume.
    sched, worker = make(slots=4096, swa=100, budget=48, max_running=8)
    prompts = {f"r{i}": [rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 12))] for i in range(8)}
    for rid, p in prompts.items():
        sched.add_request(req(rid, p, max_tokens=40))
    outputs, ends = run(sched, worker, 2)
    assert sched.stats.retractions > 0
    for rid, p in prompts.items():
        assert outputs[rid] == expected_output(p, 40) and ends[rid][0] == "length", rid
    assert sched.kv.hybrid is not None
    sched.kv.hybrid.check_integrity()


@pytest.mark.parametrize("right", [0, 2, 4])
@pytest.mark.parametrize("depth", [1, 2])
def test_rejected_drafts_give_back_no_sliding_kv_a_query_still_reads(depth: int, right: int) -> None:
    """Draft tokens are committed, then the rejected ones rolled back: what goes back is counted after
    that."""

    def drafter(tokens: list[int], k: int) -> list[int]:
        good = expected_output(tokens, k)
        return good[:right] + [(t + 1) % VOCAB for t in good[right:]]

    sched, worker = make(depth=depth, spec=4, drafter=drafter)
    prompt = list(range(1, 41))
    sched.add_request(req("a", prompt, max_tokens=60))
    outputs, _ = run(sched, worker, depth)
    assert outputs["a"] == expected_output(prompt, 60)
    assert sched.spec.draft_tokens > 0


def test_without_the_prefix_cache_all_goes_back() -> None:
    sched, worker = make(cache=False, chunk=40)
    sched.add_request(req("a", list(range(1, 150)), max_tokens=30))
    run(sched, worker, 2)
    assert held(sched) == 0 and sched.kv.allocator.num_free == sched.kv.allocator.size


@pytest.mark.parametrize("page", [1, 2])
def test_window_ready_is_the_longest_start_whose_window_is_held(page: int) -> None:
    a = HybridAllocator(64, 64, page_size=page)
    slots = a.alloc(20)  # positions 0..19
    assert slots is not None
    assert a.window_ready(slots, 6) == 20
    a.free_window(slots[:10])  # positions 0..9 gave their sliding KV back
    assert a.window_ready(slots, 6) == 20  # a start at 20 reads 15..19
    assert a.window_ready(slots[:16], 6) == 16  # 11..15
    assert a.window_ready(slots[:14], 6) == 0  # 9..13, and any earlier start reads a freed key too
    assert a.window_ready(slots[:14], 1) == 14  # a window of one reads no earlier key
    b = HybridAllocator(64, 64, page_size=page)
    slots = b.alloc(20)
    assert slots is not None
    b.free_window(slots[10:12])  # a hole at 10, 11
    assert b.window_ready(slots, 4) == 20  # 17..19
    assert b.window_ready(slots[:13], 4) == 10  # 10..12 holds the hole: back to 10, which reads 7..9
    a.check_integrity()
    b.check_integrity()


def test_the_allocators_check_catches_a_broken_map() -> None:
    a = HybridAllocator(32, 32)
    slots = a.alloc(4)
    assert slots is not None
    a.swa_page[slots[1]] = a.swa_page[slots[0]]  # two full pages on one sliding page
    with pytest.raises(AssertionError, match="mapped twice"):
        a.check_integrity()
    b = HybridAllocator(32, 32)
    slots = b.alloc(4)
    assert slots is not None
    b.swa_page[slots[0]] = 0  # a sliding page neither mapped nor free
    with pytest.raises(AssertionError, match="leaked"):
        b.check_integrity()


def test_pool_sizes_give_the_memory_past_the_sliding_cap_to_the_full_pool(monkeypatch) -> None:
    """worker/memory.py: the sliding pool holds what the running requests can hold at once (a window and two
    pages each, two steps' tokens, a page); the rest of the memory budget goes to the full pool, which only
    the global layers use. Without the pool (off, or a host tier) every layer shares one."""
    import torch

    from tandem.protocol.model_config import ModelConfig
    from tandem.worker import memory

    hf = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "intermediate_size": 128,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    }
    mc = ModelConfig.from_hf(hf)
    monkeypatch.setattr(memory, "_free_bytes", lambda device: 10 << 20)
    budget, f32, cpu = 5 << 20, torch.float32, torch.device("cpu")
    cfg = EngineConfig(model="x", max_running_requests=4, max_num_batched_tokens=64, kv_memory_fraction=0.5)
    full, swa = memory.kv_pool_sizes(cfg, mc, f32, cpu, useful_max=10**9)
    per_full, per_swa = (memory.kv_bytes_per_token(mc, f32, layers=n) for n in (1, 2))
    assert swa == 4 * (WINDOW + 2) + 2 * 64 + 1
    assert full == (budget - swa * per_swa) // per_full > budget // (per_full + per_swa)
    for off in (EngineConfig(model="x", kv_memory_fraction=0.5, sliding_window_kv=False),
                EngineConfig(model="x", kv_memory_fraction=0.5, host_kv_tokens=64)):
        assert memory.kv_pool_sizes(off, mc, f32, cpu, useful_max=10**9) == (
            budget // (per_full + per_swa),
            0,
        )
    given = EngineConfig(model="x", kv_cache_tokens=100, max_running_requests=64)
    assert memory.kv_pool_sizes(given, mc, f32, cpu, useful_max=10**9) == (100, 100)  # never more than full

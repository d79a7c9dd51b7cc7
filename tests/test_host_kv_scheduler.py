"""The host KV tier under the scheduler, against the fake worker (which runs the step's copies and checks
that every KV slot a request reads holds that request's prefix): multi-turn conversations with a device
pool of 1/8 of the working set, aborts while a load is in flight, retraction and random aborts under load."""
from __future__ import annotations

import random

import pytest

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.model_info import ModelInfo
from tandem.scheduler.scheduler import Scheduler
from tests.fake_worker import VOCAB, FakeWorker, expected_output
from tests.test_scheduler_core import req, run


def make(slots: int, host: int, depth: int = 1, page: int = 1, policy: str = "write_back",
         max_running: int = 64, budget: int = 256) -> tuple[Scheduler, FakeWorker]:
    cfg = EngineConfig(
        model="x",
        max_num_batched_tokens=budget,
        max_running_requests=max_running,
        async_scheduling=depth == 2,
        page_size=page,
        host_kv_tokens=host,
        host_kv_policy=policy,
        debug_integrity=True,
    )
    info = ModelInfo(vocab_size=VOCAB, max_model_len=1024, eos_token_ids=[0], architecture="fake")
    return Scheduler(cfg, info, slots), FakeWorker(slots + page - 1)


def conversations(sched: Scheduler, worker: FakeWorker, depth: int, n_conv: int, turns: int, user: int,
                  out: int, seed: int = 0) -> None:
    """Each turn resends the history (previous prompts and answers) plus new user tokens; the answers
    must be what the toy model gives for exactly that history."""
    rng = random.Random(seed)
    hist: list[list[int]] = [[] for _ in range(n_conv)]
    for t in range(turns):
        prompts = [h + [rng.randrange(1, VOCAB) for _ in range(user)] for h in hist]
        for c, p in enumerate(prompts):
            sched.add_request(req(f"c{c}t{t}", p, max_tokens=out))
        outputs, ends = run(sched, worker, depth)
        for c, p in enumerate(prompts):
            assert outputs[f"c{c}t{t}"] == expected_output(p, out), f"conversation {c} turn {t}"
            assert ends[f"c{c}t{t}"][0] == "length"
            hist[c] = p + outputs[f"c{c}t{t}"]


def idle_accounting(sched: Scheduler) -> None:
    kv = sched.kv
    kv.check_integrity([])
    assert kv.tree.protected_size == 0 and kv.available_slots == kv.allocator.size
    assert kv.tree.host_used == len(kv.tree.all_host_slots())


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_small_device_pool_with_host_tier_gives_same_outputs_and_hits(
    depth: int, page: int, policy: str
) -> None:
    # 16 conversations x 4 turns of 24 user + 8 output tokens: 2048 tokens of KV, the device holds 1/8.
    shape = dict(n_conv=16, turns=4, user=24, out=8)
    sched, worker = make(256, 4096, depth, page, policy, max_running=2)
    conversations(sched, worker, depth, **shape)
    assert sched.kv.host_hit_tokens > 1000, "later turns should find their history in the host tier"
    assert worker.copied_to_device == sched.kv.host_hit_tokens
    assert worker.copied_to_host > 0
    idle_accounting(sched)

    plain, plain_worker = make(256, 0, depth, page, max_running=2)
    conversations(plain, plain_worker, depth, **shape)
    saved = plain.stats.prefill_tokens - sched.stats.prefill_tokens
    assert saved == sched.kv.host_hit_tokens, "every token loaded from the host is one not recomputed"


def _evicted_to_host(depth: int) -> tuple[Scheduler, FakeWorker, list[int]]:
    """A cached 64-token prompt pushed out of the 96-slot device pool into the host tier by other traffic."""
    sched, worker = make(96, 512, depth)
    rng = random.Random(5)
    prompt = [rng.randrange(1, VOCAB) for _ in range(64)]
    sched.add_request(req("first", prompt, max_tokens=2))
    run(sched, worker, depth)
    sched.add_request(req("other", [rng.randrange(1, VOCAB) for _ in range(80)], max_tokens=2))
    run(sched, worker, depth)
    assert sched.kv.tree.match_prefix(prompt).host_hit_length == 64
    return sched, worker, prompt


@pytest.mark.parametrize("depth", [1, 2])
def test_abort_while_the_load_is_in_flight_frees_everything_once(depth: int) -> None:
    sched, worker, prompt = _evicted_to_host(depth)
    sched.add_request(req("again", prompt + [3, 4], max_tokens=20))
    so = sched.schedule()
    assert so is not None and so.kv_copies is not None and len(so.kv_copies.to_device_src) == 64
    sched.abort("again")  # its first step (the load and the prefill) is still at the worker
    assert "again" in sched.reqs
    sched.commit(worker.execute(so))
    assert "again" not in sched.reqs
    outputs, ends = run(sched, worker, depth)
    idle_accounting(sched)
    # The loaded prefix stays cached, and is right: a later request reads it.
    sched.add_request(req("third", prompt + [7], max_tokens=3))
    outputs, ends = run(sched, worker, depth)
    assert outputs["third"] == expected_output(prompt + [7], 3)
    idle_accounting(sched)


def test_a_request_holds_its_prefix_as_one_handle() -> None:
    """Admission swaps the matched handle (no device part, a host part) for the loaded one, all on the
    device; the request's protected length is the handle's, and finishing lets go of it."""
    sched, worker, prompt = _evicted_to_host(1)
    sched.add_request(req("again", prompt + [3, 4], max_tokens=2))
    r = sched.reqs["again"]
    so = sched.schedule()
    assert so is not None and r.prefix is not None and r.prefix.host_hit_length == 0
    assert r.cache_protected_len == len(r.prefix.indices) == sched.kv.host_hit_tokens >= 64
    assert sched.kv.tree.protected_size == r.cache_protected_len == r.cached_tokens
    sched.commit(worker.execute(so))
    run(sched, worker, 1)
    assert r.finished() and r.prefix is None and r.cache_protected_len == 0
    idle_accounting(sched)


def test_admission_that_does_not_fit_queues_no_load() -> None:
    sched, worker, prompt = _evicted_to_host(1)
    sched.add_request(req("big", list(range(1, 90)), max_tokens=4))  # takes most of the device pool
    so = sched.schedule()
    assert so is not None
    sched.add_request(req("again", prompt + [1], max_tokens=2))
    so2 = sched.schedule()  # no room for the load while "big" runs: it waits, its match undone
    assert so2 is not None and not so2.new_reqs
    assert so2.kv_copies is None or not so2.kv_copies.to_device_src
    assert sched.kv.tree.protected_size == sched.reqs["big"].cache_protected_len
    sched.commit(worker.execute(so))
    sched.commit(worker.execute(so2))
    outputs, _ = run(sched, worker, 1)
    assert outputs["again"] == expected_output(prompt + [1], 2)
    idle_accounting(sched)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [1, 2])
def test_retraction_and_random_aborts_with_loads_never_leak(seed: int, depth: int) -> None:
    """Requests sharing prefixes, a device pool too small for them all (retractions), a host tier, and
    random aborts: every request ends exactly once, the others' outputs are right, nothing leaks."""
    rng = random.Random(seed)
    sched, worker = make(160, 1024, depth, page=2, budget=64)
    bases = [[rng.randrange(1, VOCAB) for _ in range(48)] for _ in range(4)]
    prompts = {}
    for i in range(40):
        p = rng.choice(bases)[: rng.randrange(8, 48)] + [
            rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 9))
        ]
        prompts[f"r{i}"] = (p, rng.randrange(2, 24))
    order = list(prompts)
    aborted: set[str] = set()

    def on_step(step: int) -> None:
        if step % 3 == 0 and order:
            for _ in range(rng.randrange(1, 4)):
                if order:
                    rid = order.pop(0)
                    p, n = prompts[rid]
                    sched.add_request(req(rid, p, max_tokens=n))
        if rng.random() < 0.1 and sched.reqs:
            rid = rng.choice(sorted(sched.reqs))
            aborted.add(rid)
            sched.abort(rid)

    outputs, ends = {}, {}
    while order or sched.has_work or sched.inflight:
        o, e = run(sched, worker, depth, on_step=on_step)
        for rid, toks in o.items():
            outputs.setdefault(rid, []).extend(toks)
        assert not set(e) & set(ends), "a request ended twice"
        ends.update(e)
    assert set(ends) == set(prompts), "every request ends exactly once"
    for rid, (p, n) in prompts.items():
        if ends[rid][0] == "abort":
            assert (
                rid in aborted and outputs.get(rid, []) == expected_output(p, n)[: len(outputs.get(rid, []))]
            )
        else:
            assert outputs[rid] == expected_output(p, n), rid
    assert sched.stats.retractions > 0 and sched.kv.host_hit_tokens > 0, "the scenario must exercise both"
    idle_accounting(sched)


@pytest.mark.parametrize(
    "opts, field",
    [
        ({"host_kv_tokens": -1}, "host_kv_tokens"),
        ({"host_kv_tokens": 64, "prefix_cache": False}, "host_kv_tokens"),
        ({"host_kv_tokens": 10, "page_size": 4}, "host_kv_tokens"),
        ({"host_kv_tokens": 64, "host_kv_policy": "write_around"}, "host_kv_policy"),
    ],
)
def test_bad_host_tier_options_are_rejected(opts: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="x", **opts)


def test_idle_check_catches_a_leak_in_either_tier() -> None:
    sched, worker, _ = _evicted_to_host(1)
    sched.kv.check_idle()
    leaked = sched.kv.allocator.alloc(1)
    with pytest.raises(AssertionError, match="idle KV"):
        sched.kv.check_idle()
    sched.kv.allocator.free(leaked or [])
    host = sched.kv.tree.host.pool  # type: ignore[attr-defined]
    host.alloc(1)  # a host page neither free nor in the tree
    with pytest.raises(AssertionError, match="host pages leaked"):
        sched.kv.check_idle()

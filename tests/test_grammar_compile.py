"""Grammar compilation as the scheduler runs it: a per-grammar deadline (typed error past it), an abort
that cancels a queued compilation, an internal failure not blamed on the client's grammar; and the
waiting-queue bound (typed `overloaded`)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import OverloadedError, error_from_code
from tandem.protocol.messages import RequestError, TokenBatch, TokenizedRequest
from tandem.protocol.model_info import ModelInfo, read_model_info
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.structured import COMPILE_THREADS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sched(tiny_model) -> Scheduler:
    model = tiny_model("llama")
    cfg = EngineConfig(model=str(model), grammar_compile_timeout_s=5.0, max_waiting_requests=3)
    s = Scheduler(cfg, read_model_info(model), 1024)
    s.structured.clock = Clock()
    yield s
    s.structured.compiler().shutdown(wait=True)


def busy_pool(s: Scheduler) -> threading.Event:
    """Every compile thread waits on the returned event: compilations queue behind it."""
    gate = threading.Event()
    for _ in range(COMPILE_THREADS):
        s.structured.compiler()._pool.submit(gate.wait)
    return gate


def ends(s: Scheduler) -> dict[str, tuple[str, object]]:
    out: dict[str, tuple[str, object]] = {}
    for msg in s.take_outbox():
        if isinstance(msg, RequestError):
            out[msg.rid] = ("error", msg.code)
        elif isinstance(msg, TokenBatch):
            out.update({d.rid: (d.finish_reason, d.matched_stop) for d in msg.deltas if d.finish_reason})
    return out


def constrained(rid: str, schema: dict = SCHEMA) -> TokenizedRequest:
    return TokenizedRequest(rid, [5, 6, 7], SamplingParams(max_tokens=8, json_schema=schema))


def test_compile_past_the_deadline_fails_typed(sched: Scheduler) -> None:
    gate = busy_pool(sched)
    sched.add_request(constrained("slow"))
    sched.structured.clock.now = 4.0
    sched.admit_compiled()
    assert ends(sched) == {} and "slow" in sched.reqs  # still within its deadline
    sched.structured.clock.now = 5.5
    sched.admit_compiled()
    assert ends(sched) == {"slow": ("error", "request_failed.grammar_timeout")}
    assert not sched.reqs and not sched.structured.compiling
    gate.set()
    sched.check_integrity()


def test_abort_cancels_a_queued_compilation(sched: Scheduler) -> None:
    gate = busy_pool(sched)
    sched.add_request(constrained("a"))
    fut = sched.structured.compiling["a"][1]
    sched.abort("a")
    assert ends(sched) == {"a": ("abort", None)}
    assert fut.cancelled() and not sched.structured.compiling
    gate.set()
    svc = sched.structured.compiler()
    svc._pool.submit(lambda: None).result(timeout=30)  # the pool has drained
    assert svc.num_compiled == 0  # the cancelled grammar never compiled


def test_abort_keeps_a_compilation_another_request_awaits(sched: Scheduler) -> None:
    gate = busy_pool(sched)
    sched.add_request(constrained("a"))
    sched.add_request(constrained("b"))
    fut = sched.structured.compiling["b"][1]
    sched.abort("a")
    assert not fut.cancelled()
    gate.set()
    fut.result(timeout=60)
    sched.admit_compiled()
    assert list(sched.waiting) == [sched.reqs["b"]]


def test_internal_failure_is_not_the_clients_grammar(tmp_path: Path) -> None:
    # A model directory whose tokenizer cannot load: the compiler fails, the schema is fine.
    cfg = EngineConfig(model=str(tmp_path))
    s = Scheduler(cfg, ModelInfo(vocab_size=100, max_model_len=64, eos_token_ids=[0], architecture="x"), 256)
    s.add_request(constrained("r"))
    s.structured.compiling["r"][1].exception(timeout=60)
    s.admit_compiled()
    assert ends(s) == {"r": ("error", "internal_error.grammar")}


def test_waiting_queue_bound_is_a_typed_overloaded_error(sched: Scheduler) -> None:
    for i in range(4):
        sched.add_request(TokenizedRequest(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert ends(sched) == {"r3": ("error", "overloaded")}
    assert [r.rid for r in sched.waiting] == ["r0", "r1", "r2"]
    assert isinstance(error_from_code("overloaded", "full"), OverloadedError)


def test_distinct_grammars_waiting_to_compile_are_bounded_typed(tiny_model) -> None:
    model = tiny_model("llama")
    s = Scheduler(EngineConfig(model=str(model)), read_model_info(model), 1024)
    gate = busy_pool(s)
    svc = s.structured.compiler()
    svc.max_pending = 3  # MAX_PENDING scaled down
    for i in range(5):  # 5 distinct grammars, 2 more requests for one already queued
        s.add_request(constrained(f"r{i}", {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))
    s.add_request(constrained("again0", {"type": "object", "properties": {"k0": {"type": "integer"}}}))
    s.admit_compiled()
    assert ends(s) == {"r3": ("error", "overloaded"), "r4": ("error", "overloaded")}
    gate.set()
    for rid in ("r0", "r1", "r2", "again0"):
        s.structured.compiling[rid][1].result(timeout=60)
    s.admit_compiled()
    assert sorted(r.rid for r in s.waiting) == ["again0", "r0", "r1", "r2"]
    svc.shutdown(wait=True)


def test_the_compiled_grammar_cache_is_bounded_by_count_and_bytes(tiny_model) -> None:
    from tandem.scheduler.grammar import GrammarCompilerService, GrammarSpec

    model = tiny_model("llama")
    svc = GrammarCompilerService(str(model), read_model_info(model).vocab_size, cache_size=1000)
    one = svc.compile(GrammarSpec("regex", "[a-z]{1,40}x"))
    svc.cache_bytes = int(2.5 * one.memory_size_bytes)  # CACHE_BYTES scaled down: two fit, three do not
    on_done = svc._on_done
    # The room is made before the grammar is handed out, not after, when the future's callbacks run: a
    # stats request served in between (the soak's sampler) must not see the cache past its bound.
    svc._on_done = lambda key, fut: (time.sleep(0.2), on_done(key, fut))
    for i in range(6):
        svc.compile(GrammarSpec("regex", f"[a-z]{{1,40}}x{i}"))
        assert svc.cached_bytes <= svc.cache_bytes
    assert len(svc._cache) < 4
    svc.cache_size, svc.cache_bytes = 2, 10**12
    svc.compile(GrammarSpec("regex", "y+"))
    assert len(svc._cache) <= 2 and svc.compile(GrammarSpec("regex", "y+")) is not None
    svc.shutdown()

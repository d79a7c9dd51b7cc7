"""`tandem bench soak`, short, on the tiny model: every kind of traffic goes through both doors at once, every
request ends exactly once as its kind predicts, the engine retracts, reloads from the host tier and
speculates meanwhile, and ends with its KV pool whole, its integrity check clean, still answering, and
stops with nothing left behind. The growth and TPOT verdicts need minutes on a quiet machine (the recorded
10-minute run, benchmarks/results/soak/README.md): here they are only required to be present, and the exit
code to follow the verdicts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.worker.heap_keeper import HeapKeeper

pytestmark = pytest.mark.slow  # 45 s of traffic: the slower tier (make test-slow)

CORRECTNESS = {
    "traffic threads all returned", "every request ended", "no request ended twice",
    "every outcome is the one its kind predicts", "the engine ended each request it was given exactly once",
    "KV free back to the whole pool", "nothing left running or pending", "prefix-cache integrity",
    "grammar cache within its bound", "engine still answering (ZMQ, HTTP, /health)",
    "engine stops cleanly (exit 0, no process left)", "greedy outputs under load equal the idle engine's",
}
TIMING = {"no RSS or fd growth after warm-up", "p99 TPOT stable (first vs last 10%)"}
HEAP = "worker heap in use flat after warm-up"  # present with enough heap samples after warm-up (glibc)


def test_a_short_soak_ends_every_request_once_and_leaves_the_engine_whole(tiny_model, tmp_path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tandem.launch.cli",
        "bench",
        "soak",
        "--model",
        str(tiny_model("llama")),
        "--dtype",
        "float32",
        "--minutes",
        "0.75",
        "--sample-s",
        "5",
        "--zmq-threads",
        "4",
        "--http-clients",
        "4",
        "--speculative-method",
        "ngram",
        "--grammar-compile-timeout-s",
        "0.1",
        "--heap-trim-period-s",
        "5",
        "--result-dir",
        str(tmp_path),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    verdicts = {c["name"]: c for c in result["checks"]}
    assert set(verdicts) - {HEAP} == CORRECTNESS | TIMING, set(verdicts)
    failed = [f"{n}: {c['detail']}" for n, c in verdicts.items() if n in CORRECTNESS and not c["ok"]]
    assert not failed, failed
    assert r.returncode == (0 if all(c["ok"] for c in verdicts.values()) else 1), r.stdout[-2000:]
    kinds = {k.split(" -> ")[0] for k in result["by_kind_and_outcome"]}
    for kind in ("zmq.greedy", "zmq.cancelled", "zmq.stream_left", "zmq.logprobs", "zmq.json", "zmq.slow_grammar",
                 "zmq.raw.too_large", "zmq.raw.malformed", "http.stream_left", "http.chat_stream",
                 "http.echo_logprobs", "http.bad.too_large"):
        assert kind in kinds, (kind, sorted(kinds))
    assert any(k.startswith("zmq.bad.") for k in kinds) and any(k.startswith("http.bad.") for k in kinds)
    engine = result["engine_counters"]
    # The pool is small enough to retract, the host tier reloads prefixes, speculation drafts.
    assert engine["retractions"] > 0 and engine["host_hit_tokens"] > 0 and engine["spec_draft_tokens"] > 0, (
        engine
    )
    assert len(result["samples"]) >= 5
    heaps = [s["engine"]["worker_heap"] for s in result["samples"] if s["engine"].get("worker_heap")]
    if HeapKeeper(1.0).available:  # the worker trimmed its heap every 5 s and its samples reached the stats
        assert heaps and heaps[-1]["trims"] >= 3 and heaps[-1]["in_use"] > 0, heaps[-1:]

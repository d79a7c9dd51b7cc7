"""`tandem bench soak`: N minutes of mixed traffic against one `tandem serve`, through every door at once,
sampled every `sample_s`; writes LABEL.json and LABEL.png and returns non-zero when a check fails.

The traffic: Client threads (generate, streams read whole or left early, chat, logprobs and prompt logprobs,
JSON schemas, choices, every bad request the validation knows, request ids reused across clients), an
AsyncClient whose calls are cancelled, raw frames no library sends, one grammar at a time that outlasts the
compile timeout, and aiohttp clients (completions and chat, streamed or not, streams closed early, JSON mode,
echoed logprobs, bad requests, bodies over the limit, health checks). The engine options are the user's;
the soak's defaults turn on speculation, a host KV tier and a device pool small enough to retract.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from tandem import Client
from tandem.benchmarks.soak.checks import (
    Check,
    engine_checks,
    greedy_check,
    growth_checks,
    ledger_checks,
    tpot_check,
)
from tandem.benchmarks.soak.engine import ServedEngine
from tandem.benchmarks.soak.http_traffic import HttpTraffic
from tandem.benchmarks.soak.kinds import CHOICES, SCHEMAS, SLOW_FACTOR, Shape
from tandem.benchmarks.soak.ledger import Ledger
from tandem.benchmarks.soak.plot import plot
from tandem.benchmarks.soak.sampler import Sampler
from tandem.benchmarks.soak.zmq_traffic import GREEDY, ZmqTraffic, greedy_prompt
from tandem.benchmarks.workload import usable_token_ids
from tandem.frontend.client.engine_process import config_to_argv
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode, TandemError
from tandem.protocol.model_info import read_model_info

SERVED_NAME = "soak"


def run(cfg: EngineConfig, minutes: float, zmq_threads: int, http_clients: int, sample_s: float,
        warmup_s: float | None, tpot_ratio: float, result_dir: Path, label: str, seed: int) -> int:
    duration = minutes * 60
    warmup = warmup_s if warmup_s is not None else max(30.0, 0.3 * duration)
    engine = ServedEngine([*config_to_argv(cfg), "--port", "0", "--served-model-name", SERVED_NAME])
    try:
        return _soak(cfg, engine, duration, zmq_threads, http_clients, sample_s, warmup, tpot_ratio,
                     result_dir, label, seed)
    finally:
        engine.stop()


def _soak(cfg: EngineConfig, engine: ServedEngine, duration: float, zmq_threads: int, http_clients: int,
          sample_s: float, warmup: float, tpot_ratio: float, result_dir: Path, label: str, seed: int) -> int:
    info = read_model_info(cfg.model, cfg.max_model_len)
    shape = Shape(SERVED_NAME, info.vocab_size, info.max_model_len, tuple(usable_token_ids(cfg.model)),
                  cfg.max_request_bytes, cfg.grammar_compile_timeout_s)
    ledger = Ledger()
    probe = Client(engine.endpoint)
    _compile_grammars(probe)
    before = probe.stats()
    sampler = Sampler(engine, ledger, sample_s)
    sampler.sample()
    sampler.start()
    t0 = time.monotonic()
    deadline = t0 + duration
    zmq = ZmqTraffic(engine.endpoint, shape, ledger, deadline)
    http = HttpTraffic(engine.url, shape, ledger, deadline)
    # its compile ends before the next
    slow_period = max(20.0, 3 * SLOW_FACTOR * cfg.grammar_compile_timeout_s)
    threads = [
        threading.Thread(target=zmq.worker, args=(seed + i,), name=f"zmq-{i}") for i in range(zmq_threads)
    ]
    threads += [threading.Thread(target=zmq.cancelled_calls, args=(seed + 100,), name="cancel"),
                threading.Thread(target=zmq.slow_grammars, args=(slow_period,), name="slow-grammar"),
                threading.Thread(target=zmq.raw_frames, args=(2.0, 30), name="raw"),
                threading.Thread(target=http.run, args=(http_clients, seed + 200, 60.0), name="http")]
    for t in threads:
        t.start()
    print(
        f"soak: {duration / 60:g} min of traffic, {zmq_threads} Client threads, {http_clients} HTTP clients; "
        f"samples every {sample_s:g} s, warm-up {warmup:g} s",
        flush=True,
    )
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()) + 300)
    hung = [t.name for t in threads if t.is_alive()]
    idle_by = time.monotonic() + 120
    while time.monotonic() < idle_by:  # the last aborts and overruns settle
        st = probe.stats()
        if not (st.running or st.waiting or st.inflight_steps or st.frontend_pending):
            break
        time.sleep(0.5)
    sampler.stop()
    sampler.sample()
    sampler.close()
    after = probe.stats()
    records = ledger.snapshot()
    ended = (after.requests_finished + after.requests_failed) - (
        before.requests_finished + before.requests_failed
    )
    checks = [Check("traffic threads all returned", not hung, ", ".join(hung) or "all")]
    checks += ledger_checks(records, ended) + engine_checks(after)
    checks += growth_checks(sampler.samples, warmup)
    checks.append(tpot_check(records, t0, deadline, tpot_ratio))  # the traffic's span, not the settling after
    alone = {i: list(probe.generate(greedy_prompt(shape, i), GREEDY).token_ids) for i in zmq.greedy_outputs}
    checks.append(greedy_check(zmq.greedy_outputs, alone))
    checks.append(_still_answering(probe, engine.url))
    probe.close()
    zmq.close()
    kids = engine.processes()
    code = engine.stop()
    left = [n for n, p in kids.items() if p.is_running() and p.pid != engine.proc.pid]
    checks.append(Check("engine stops cleanly (exit 0, no process left)", code == 0 and not left,
                        f"exit {code}, left: {left}"))
    return _report(
        cfg, records, sampler.samples, checks, before, after, result_dir, label, warmup, duration, t0
    )


def _compile_grammars(client: Client) -> None:
    """Every grammar the traffic uses is compiled once here, so that later requests find it cached, within
    any timeout. A compilation past the timeout goes on and is cached: asking again finds it."""
    for constraint in [{"json_schema": s} for s in SCHEMAS] + [{"json_object": True}, {"choice": CHOICES},
                                                                 {"regex": "(["}]:
        for _ in range(60):
            try:
                client.generate("warm up", {"max_tokens": 4, **constraint})
                break
            except TandemError as e:
                if e.code == ErrorCode.INVALID_GRAMMAR:  # the bad one: its error is cached too
                    break
                if e.code != ErrorCode.GRAMMAR_TIMEOUT:
                    raise
                time.sleep(0.5)


def _still_answering(client: Client, url: str) -> Check:
    try:
        c = client.generate("still there?", {"max_tokens": 4, "ignore_eos": True})
        body = json.dumps(
            {"model": SERVED_NAME, "prompt": "still there?", "max_tokens": 4, "ignore_eos": True}
        )
        req = urllib.request.Request(
            url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            http_tokens = json.loads(r.read())["usage"]["completion_tokens"]
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            health = r.status
    except Exception as e:
        return Check("engine still answering (ZMQ, HTTP, /health)", False, f"{type(e).__name__}: {e}")
    ok = c.completion_tokens == 4 and http_tokens == 4 and health == 200
    return Check(
        "engine still answering (ZMQ, HTTP, /health)", ok, f"{c.completion_tokens}, {http_tokens}, {health}"
    )


def _report(cfg: EngineConfig, records: list, samples: list[dict[str, Any]], checks: list[Check], before: Any,
            after: Any, result_dir: Path, label: str, warmup: float, duration: float, t0: float) -> int:
    from collections import Counter

    kinds = Counter((r.kind, r.outcome) for r in records)
    unexpected = [asdict(r) for r in records if r.ends != 1 or not r.as_expected][:200]
    counters = {k: getattr(after, k) - getattr(before, k) for k in (
        "requests_finished", "requests_failed", "requests_aborted", "retractions", "steps", "prefill_tokens",
        "decode_tokens", "host_hit_tokens", "spec_draft_tokens", "spec_accepted_tokens")}
    result = {
        "config": {**cfg.options(), "model": cfg.model, "minutes": duration / 60, "warmup_s": warmup},
        "cpu": _cpu_name(),
        "requests": len(records),
        "by_kind_and_outcome": {f"{k} -> {o}": n for (k, o), n in sorted(kinds.items(), key=str)},
        "engine_counters": counters,
        "checks": [asdict(c) for c in checks],
        "samples": samples,
        "unexpected_records": unexpected,
        # Every request, compact: kind, outcome, start and end (s from the start of the traffic), TTFT, TPOT.
        "records": [
            [
                r.kind,
                r.outcome,
                round(r.start - t0, 3),
                None if r.end_t is None else round(r.end_t - t0, 3),
                r.ttft and round(r.ttft, 4),
                r.tpot and round(r.tpot, 4),
            ]
            for r in records
        ],
    }
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / f"{label}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    png = plot(samples, result_dir / f"{label}.png", f"tandem bench soak: {Path(cfg.model).name}, "
               f"{duration / 60:g} min, {len(records)} requests", warmup)
    print(f"soak: {len(records)} requests; engine counters {counters}")
    for c in checks:
        print(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    print(f"wrote {path}\nwrote {png}")
    return 0 if all(c.ok for c in checks) else 1


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{psutil.cpu_count()} cpus"

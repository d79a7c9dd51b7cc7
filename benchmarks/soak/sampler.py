"""Every `period_s`: each engine process's RSS and open fds, the engine's stats (KV, running / waiting,
integrity), and over the requests that ended since the last sample, TTFT / TPOT percentiles and the
outcomes by code."""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import psutil

from tandem import Client
from tandem.benchmarks.soak.engine import ServedEngine
from tandem.benchmarks.soak.ledger import Ledger


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1000 if xs else None  # ms


class Sampler:
    def __init__(self, engine: ServedEngine, ledger: Ledger, period_s: float) -> None:
        self.engine, self.ledger, self.period_s = engine, ledger, period_s
        self.client = Client(engine.endpoint)
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)
        self._last = self.t0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No more periodic samples (sample() still works until close())."""
        self._stop.set()
        self._thread.join()

    def close(self) -> None:
        self.client.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        procs: dict[str, dict[str, float]] = {}
        for name, p in self.engine.processes().items():
            try:
                procs[name] = {"rss_mb": p.memory_info().rss / 2**20, "fds": p.num_fds()}
            except psutil.Error:
                continue
        try:
            st = self.client.stats(timeout_s=30)
            stats: dict[str, Any] = {
                k: getattr(st, k)
                for k in (
                    "kv_pool_size",
                    "kv_free",
                    "kv_cached",
                    "kv_cache_locked",
                    "running",
                    "waiting",
                    "retractions",
                    "requests_finished",
                    "requests_failed",
                    "requests_aborted",
                    "host_hit_tokens",
                    "host_kv_used",
                    "spec_draft_tokens",
                    "spec_accepted_tokens",
                    "grammar_cache_bytes",
                    "integrity",
                )
            }
            stats["worker_heap"] = None if st.worker_heap is None else msgspec.structs.asdict(st.worker_heap)
        except Exception as e:  # recorded: the checks fail an engine that stops answering
            stats = {"error": f"{type(e).__name__}: {e}"}
        ended = [r for r in self.ledger.snapshot() if r.end_t is not None and self._last < r.end_t <= now]
        ttft = [r.ttft for r in ended if r.ttft is not None]
        tpot = [r.tpot for r in ended if r.tpot is not None]
        sample = {
            "t": now - self.t0, "procs": procs, "engine": stats,
            "ended": len(ended), "outcomes": dict(Counter(r.outcome for r in ended)),
            "unexpected": sum(not r.as_expected for r in ended),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99),
        }
        self._last = now
        self.samples.append(sample)
        return sample

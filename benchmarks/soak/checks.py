"""The soak's verdicts, from the ledger, the samples and the engine's final stats (pure functions).

Growth is judged after warm-up by a least-squares line through each process's samples: its rise over the
measured window must stay within RSS_TOLERANCE_MB plus RSS_TOLERANCE_SHARE of the process's size (for open
fds, FD_TOLERANCE). Noise on a busy machine moves single samples, not a fitted slope over many. The
scheduler's compiled-grammar cache is bounded on its own (CACHE_BYTES) and reported in the stats: it is
checked against that bound, and taken out of the scheduler's RSS before the slope.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.benchmarks.soak.ledger import Record
from tandem.scheduler.grammar import CACHE_BYTES

RSS_TOLERANCE_MB = 16.0
RSS_TOLERANCE_SHARE = 0.02
FD_TOLERANCE = 4.0
MIN_GROWTH_SAMPLES = 4


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def ledger_checks(records: list[Record], engine_ended: int) -> list[Check]:
    """engine_ended: requests the scheduler ended (finished + failed) during the traffic."""
    lost = [r for r in records if r.ends == 0]
    doubled = [r for r in records if r.ends > 1]
    unexpected = [r for r in records if r.ends and not r.as_expected]
    by = Counter((r.kind, r.outcome, r.detail[:60]) for r in unexpected)
    reached = sum(r.reaches_scheduler for r in records)
    return [
        Check(
            "every request ended",
            not lost,
            f"{len(records)} requests, {len(lost)} never ended"
            + (f" (first: {lost[0].kind})" if lost else ""),
        ),
        Check("no request ended twice", not doubled, f"{len(doubled)} ended more than once"),
        Check(
            "every outcome is the one its kind predicts",
            not unexpected,
            f"{len(unexpected)} unexpected"
            + "".join(f"; {n} x {k} -> {o} {d}" for (k, o, d), n in by.most_common(5)),
        ),
        Check(
            "the engine ended each request it was given exactly once",
            engine_ended == reached,
            f"scheduler ended {engine_ended}, the soak sent it {reached}",
        ),
    ]


def greedy_check(under_load: dict[int, list[list[int]]], alone: dict[int, list[int]]) -> Check:
    """Greedy outputs of a few fixed prompts, taken under load (batched with anything, retracted,
    re-prefilled, reloaded from the host tier, speculated), equal the same prompts run one at a time on the
    idle engine, token for token."""
    runs = sum(map(len, under_load.values()))
    parted = [(i, k) for i, outs in under_load.items() for k, out in enumerate(outs) if out != alone[i]]
    first = ""
    if parted:
        i, k = parted[0]
        at = next((j for j, (a, b) in enumerate(zip(under_load[i][k], alone[i])) if a != b), None)
        first = f"; first: prompt {i} run {k} parts at token {at}"
    return Check(
        "greedy outputs under load equal the idle engine's",
        runs > 0 and not parted,
        f"{runs} runs of {len(under_load)} prompts, {len(parted)} differ{first}",
    )


def engine_checks(stats: Any) -> list[Check]:
    back = stats.kv_free + stats.kv_cached == stats.kv_pool_size and stats.kv_cache_locked == 0
    idle = stats.running == 0 and stats.waiting == 0 and stats.frontend_pending == 0
    return [
        Check(
            "KV free back to the whole pool",
            back,
            f"{stats.kv_free} free + {stats.kv_cached} cached of {stats.kv_pool_size}, {stats.kv_cache_locked} locked",
        ),
        Check(
            "nothing left running or pending",
            idle,
            f"running {stats.running}, waiting {stats.waiting}, frontend pending {stats.frontend_pending}",
        ),
        Check("prefix-cache integrity", stats.integrity == "ok", stats.integrity),
    ]


def _rise(ts: list[float], ys: list[float]) -> float:
    """The fitted line's rise over the window."""
    slope = np.polyfit(ts, ys, 1)[0]
    return float(slope * (ts[-1] - ts[0]))


def growth_checks(samples: list[dict[str, Any]], warmup_s: float) -> list[Check]:
    after = [s for s in samples if s["t"] >= warmup_s]
    if len(after) < MIN_GROWTH_SAMPLES:
        return [Check("no RSS or fd growth after warm-up", False,
                      f"only {len(after)} samples after the {warmup_s:g} s warm-up: run longer")]
    names = sorted({n for s in after for n in s["procs"]})
    bad, worst = [], []
    for name in names:
        pts = [(s["t"], s["procs"][name]) for s in after if name in s["procs"]]
        if len(pts) < MIN_GROWTH_SAMPLES:
            continue
        ts = [t for t, _ in pts]
        rss = [p["rss_mb"] for _, p in pts]
        if name == "tandem-scheduler":
            cache = [s["engine"].get("grammar_cache_bytes", 0) / 2**20 for s in after if name in s["procs"]]
            rss = [r - c for r, c in zip(rss, cache)]
        fds = [p["fds"] for _, p in pts]
        rss_rise, fd_rise = _rise(ts, rss), _rise(ts, fds)
        rss_tol = RSS_TOLERANCE_MB + RSS_TOLERANCE_SHARE * float(np.mean(rss))
        worst.append(f"{name} {rss_rise:+.1f} MB (tol {rss_tol:.0f}), {fd_rise:+.1f} fds")
        if rss_rise > rss_tol:
            bad.append(
                f"{name}: RSS rose {rss_rise:.1f} MB over {ts[-1] - ts[0]:.0f} s (tolerance {rss_tol:.0f})"
            )
        if fd_rise > FD_TOLERANCE:
            bad.append(f"{name}: open fds rose {fd_rise:.1f} (tolerance {FD_TOLERANCE:g})")
    checks = [Check("no RSS or fd growth after warm-up", not bad, "; ".join(bad or worst))]
    heap = [(s["t"], s["engine"]["worker_heap"]) for s in after if s["engine"].get("worker_heap")]
    # glibc only: a leak shows here even while RSS hides it in freed pages
    if len(heap) >= MIN_GROWTH_SAMPLES:
        ts, used = [t for t, _ in heap], [h["in_use"] / 2**20 for _, h in heap]
        rise, tol = _rise(ts, used), RSS_TOLERANCE_MB + RSS_TOLERANCE_SHARE * float(np.mean(used))
        last = heap[-1][1]
        checks.append(
            Check(
                "worker heap in use flat after warm-up",
                rise <= tol,
                f"{rise:+.1f} MB (tol {tol:.0f}); at the end {last['in_use'] / 2**20:.0f} MB in use, "
                f"{last['free'] / 2**20:.0f} MB free in the arenas, {last['trims']} trims gave back "
                f"{last['released'] / 2**20:.0f} MB",
            )
        )
    cache = max((s["engine"].get("grammar_cache_bytes", 0) for s in samples), default=0)
    return checks + [Check("grammar cache within its bound", cache <= CACHE_BYTES,
                           f"at most {cache / 2**20:.1f} MB of {CACHE_BYTES / 2**20:.0f}")]


def tpot_check(records: list[Record], t0: float, t1: float, max_ratio: float) -> Check:
    """p99 TPOT of the streams that started in the first 10% of the run against the last 10%."""
    span = t1 - t0

    def p99(lo: float, hi: float) -> float | None:
        xs = [r.tpot for r in records if r.tpot is not None and lo <= r.start - t0 < hi]
        return float(np.percentile(xs, 99)) * 1000 if len(xs) >= 5 else None

    first, last = p99(0, 0.1 * span), p99(0.9 * span, span)
    if first is None or last is None:
        return Check("p99 TPOT stable (first vs last 10%)", False, f"too few streams: {first}, {last}")
    return Check("p99 TPOT stable (first vs last 10%)", last <= max_ratio * first,
                 f"{first:.1f} ms -> {last:.1f} ms (at most x{max_ratio:g})")

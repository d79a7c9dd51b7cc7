"""The soak's PNG: over time, each process's RSS and open fds, KV free, running / waiting, TTFT and TPOT
percentiles, and the requests that ended by outcome."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def plot(samples: list[dict[str, Any]], path: Path, title: str, warmup_s: float) -> Path:
    ts = [s["t"] / 60 for s in samples]
    names = sorted({n for s in samples for n in s["procs"]})
    fig, axes = plt.subplots(3, 2, figsize=(15, 12))
    (rss, fds), (kv, load), (lat, outs) = axes

    for name in names:
        pts = [(s["t"] / 60, s["procs"][name]) for s in samples if name in s["procs"]]
        rss.plot([t for t, _ in pts], [p["rss_mb"] for _, p in pts], label=name)
        fds.plot([t for t, _ in pts], [p["fds"] for _, p in pts], label=name)
    sched = [
        (
            s["t"] / 60,
            s["procs"]["tandem-scheduler"]["rss_mb"] - s["engine"].get("grammar_cache_bytes", 0) / 2**20,
        )
        for s in samples
        if "tandem-scheduler" in s["procs"]
    ]
    rss.plot(
        [t for t, _ in sched], [m for _, m in sched], "k--", lw=0.8, label="scheduler less grammar cache"
    )
    heap = [(s["t"] / 60, s["engine"]["worker_heap"]) for s in samples if s["engine"].get("worker_heap")]
    for key, style in (("in_use", "m:"), ("free", "c:")):
        rss.plot(
            [t for t, _ in heap], [h[key] / 2**20 for _, h in heap], style, lw=1, label=f"worker heap {key}"
        )
    rss.set_title("RSS per process, worker heap after its trims (MB)")
    fds.set_title("open fds per process")

    eng = [s["engine"] for s in samples]
    for key, label in (
        ("kv_free", "free"),
        ("kv_cached", "cached (evictable)"),
        ("kv_cache_locked", "locked"),
    ):
        kv.plot(ts, [e.get(key) for e in eng], label=label)
    kv.set_title("KV slots")
    for key in ("running", "waiting"):
        load.plot(ts, [e.get(key) for e in eng], label=key)
    load.set_title("requests in the scheduler")

    for key, style in (
        ("ttft_p50_ms", "-"),
        ("ttft_p99_ms", "--"),
        ("tpot_p50_ms", "-"),
        ("tpot_p99_ms", "--"),
    ):
        lat.plot(ts, [s[key] for s in samples], style, label=key.replace("_ms", ""))
    lat.set_yscale("log")
    lat.set_title("latency per 10 s window (ms, streams)")

    codes = sorted({c for s in samples for c in s["outcomes"]}, key=str)
    for code in codes:
        outs.plot(ts, [s["outcomes"].get(code, 0) for s in samples], label=str(code))
    outs.plot(ts, [s["unexpected"] for s in samples], "k:", label="unexpected")
    outs.set_title("requests ended per window, by outcome")

    for ax in axes.flat:
        ax.axvline(warmup_s / 60, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("minutes")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

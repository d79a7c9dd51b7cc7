"""PNG plots of a `tandem bench serve` run: latency percentiles and output tok/s against request rate,
and output tok/s over time at each rate."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def _x(results: list[dict[str, Any]]) -> tuple[list[float], list[str]]:
    labels = [str(r["request_rate"]) for r in results]
    return list(range(len(results))), labels


def plot(results: list[dict[str, Any]], out_dir: Path, label: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    xs, labels = _x(results)
    paths = []

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, metric in zip(axes, ("ttft", "tpot", "itl", "e2el")):
        for pct in ("median", "p90", "p99"):
            ax.plot(xs, [r[f"{pct}_{metric}_ms"] for r in results], marker="o", label=pct)
        ax.set_title(f"{metric.upper()} (ms)")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
    fig.suptitle(f"{label}: latency against request rate")
    fig.tight_layout()
    paths.append(out_dir / f"{label}_latency.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["output_throughput"] for r in results], marker="o")
    ax.set_xticks(xs, labels)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{label}: output throughput")
    fig.tight_layout()
    paths.append(out_dir / f"{label}_throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        ax.plot(range(len(r["output_throughput_timeline"])), r["output_throughput_timeline"],
                label=f"rate {r['request_rate']}")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{label}: throughput over time")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / f"{label}_timeline.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths

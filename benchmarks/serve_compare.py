"""Several `tandem bench serve` results side by side: one PNG (output tok/s, median TTFT and TPOT against
request rate, one line per server) and a markdown table of the figures.

    python -m tandem.benchmarks.serve_compare --out DIR/compare.png A.json B.json ...   # the table on stdout
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

_COLUMNS = [("req/s", "request_throughput", 2), ("out tok/s", "output_throughput", 1),
            ("TTFT p50 ms", "median_ttft_ms", 0), ("TTFT p99 ms", "p99_ttft_ms", 0),
            ("TPOT p50 ms", "median_tpot_ms", 1), ("TPOT p99 ms", "p99_tpot_ms", 1),
            ("ITL p50 ms", "median_itl_ms", 1), ("e2e p50 ms", "median_e2el_ms", 0)]


def load(path: Path) -> tuple[str, list[dict[str, Any]]]:
    d = json.loads(path.read_text(encoding="utf-8"))
    return d["config"]["label"], d["results"]


def table(runs: list[tuple[str, list[dict[str, Any]]]]) -> str:
    head = ["server", "rate", "ok", *(c[0] for c in _COLUMNS)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, results in runs:
        for r in results:
            cells = [label, str(r["request_rate"]), f"{r['completed']}/{r['completed'] + r['failed']}",
                     *(f"{r[key]:.{digits}f}" for _, key, digits in _COLUMNS)]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(runs: list[tuple[str, list[dict[str, Any]]]], out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (title, key) in zip(axes, (("output tokens/s", "output_throughput"),
                                       ("median TTFT (ms)", "median_ttft_ms"),
                                       ("median TPOT (ms)", "median_tpot_ms"))):
        for label, results in runs:
            ax.plot(range(len(results)), [r[key] for r in results], marker="o", label=label)
        ax.set_xticks(range(len(runs[0][1])), [str(r["request_rate"]) for r in runs[0][1]])
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.benchmarks.serve_compare", allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True, help="the comparison PNG")
    p.add_argument("results", type=Path, nargs="+", help="LABEL.json files of `tandem bench serve`")
    args = p.parse_args(argv)
    runs = [load(r) for r in args.results]
    rates = [[r["request_rate"] for r in results] for _, results in runs]
    if any(r != rates[0] for r in rates):
        raise SystemExit(f"serve_compare: the runs were at different request rates: {rates}")
    plot(runs, args.out)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

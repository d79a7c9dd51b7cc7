"""The first structured-output request after `engine ready` against the same request once warm.

Each run launches a fresh engine, sends a JSON-schema request the moment the engine is ready ("first"), the
same again three times ("warm", the median), the same messages unconstrained ("free"), then a schema it has
not seen but as big ("new schema": its grammar compiles on a loaded compiler). first/warm is what a user sees
(the first request also compiles its grammar); first/new-schema is the cold start alone. `*_queue_s`: the
engine's own figure,
arrival to first step (a constrained request waits there for the compiler and its grammar). With --cold-cache
the on-disk TokenizerInfo cache is emptied
before each launch (what a first start on a machine sees).

    python -m tandem.benchmarks.structured_start --model models/smollm2-135m-instruct/model.gguf --runs 3
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any


def city(n: int) -> dict[str, Any]:
    """make demo's schema (n = 40); another n is another grammar of the same size, compiled anew."""
    return {"type": "object", "properties": {"city": {"type": "string", "maxLength": n},
                                             "country": {"type": "string", "maxLength": n}},
            "required": ["city", "country"], "additionalProperties": False}


MESSAGES = [{"role": "user", "content": "Name one city in Japan and its country, as JSON."}]


def _timed(client: Any, params: dict[str, Any]) -> tuple[float, float]:
    """(seconds from sending to the end, of which queued in the engine: before its first step, which for a
    constrained request includes waiting for the grammar compiler and compiling)."""
    t = time.perf_counter()
    out = client.generate(MESSAGES, params)
    return time.perf_counter() - t, out.metrics.queue_s if out.metrics else 0.0


def run_once(model: str, cold_cache: bool, warm_repeats: int = 3, **engine: object) -> dict[str, float]:
    from tandem import Client
    from tandem.protocol.gguf_metadata import cache_root

    if cold_cache:
        shutil.rmtree(cache_root() / "xgrammar", ignore_errors=True)
    base = {"max_tokens": 48, "temperature": 0.0}
    t0 = time.perf_counter()
    # No prefix cache: a repeated request would prefill only its last token, which the first cannot.
    with Client.launch(model, prefix_cache=False, **engine) as client:
        row = {"ready_s": time.perf_counter() - t0}
        row["first_s"], row["first_queue_s"] = _timed(client, {**base, "json_schema": city(40)})
        warm = [_timed(client, {**base, "json_schema": city(40)}) for _ in range(warm_repeats)]
        row["warm_s"] = statistics.median(w[0] for w in warm)
        row["warm_queue_s"] = statistics.median(w[1] for w in warm)
        row["free_s"], _ = _timed(client, base)
        row["new_schema_s"], row["new_schema_queue_s"] = _timed(client, {**base, "json_schema": city(39)})
    row["first_over_warm"] = row["first_s"] / row["warm_s"]
    row["first_over_new_schema"] = row["first_s"] / row["new_schema_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--cold-cache", action="store_true", help="empty the TokenizerInfo disk cache before each run"
    )
    ap.add_argument(
        "--torch-threads", type=int, help="the worker's threads (1: least disturbed by other load)"
    )
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    engine = {"torch_threads": args.torch_threads} if args.torch_threads else {}
    rows = [run_once(args.model, args.cold_cache, **engine) for _ in range(args.runs)]
    keys = ["ready_s", "first_s", "first_queue_s", "warm_s", "warm_queue_s", "free_s", "new_schema_s",
            "new_schema_queue_s", "first_over_warm", "first_over_new_schema"]
    print(" ".join(f"{k:>12.12}" for k in ["run", *keys]))
    for i, r in enumerate(rows):
        print(" ".join([f"{i:>12}", *(f"{r[k]:>12.2f}" for k in keys)]))
    print(" ".join([f"{'median':>12}", *(f"{statistics.median(r[k] for r in rows):>12.2f}" for k in keys)]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`tandem bench offline|latency`: workload flags plus every engine flag (from launch.cli_options).

`--seed` is the engine's seed flag; the benchmarks also seed their random prompts with it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from launch.cli_options import add_engine_flags, config_from_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench", description="tandem benchmarks", allow_abbrev=False)
    sub = p.add_subparsers(dest="bench", required=True)

    o = sub.add_parser("offline", help="throughput: all prompts at once, vs transformers and the roofline",
                       allow_abbrev=False)
    add_engine_flags(o)
    o.add_argument("--num-requests", type=int, default=64)
    o.add_argument("--input-len", default="64:512", help="prompt length range LOW:HIGH, inclusive")
    o.add_argument("--output-len", type=int, default=128)
    o.add_argument("--hf-batch-size", type=int, default=16, help="transformers baseline batch size")

    lat = sub.add_parser("latency", help="one request at a time: TTFT and decode tok/s, vs transformers",
                         allow_abbrev=False)
    add_engine_flags(lat)
    lat.add_argument("--prompt-len", type=int, default=64)
    lat.add_argument("--output-len", type=int, default=256)
    lat.add_argument("--num-requests", type=int, default=3, help="sequential requests; medians are reported")

    pre = sub.add_parser("prefix", help="TTFT with a shared system prompt: prefix cache on vs off; with "
                         "--host-kv-tokens, multi-turn conversations: host KV tier vs none", allow_abbrev=False)
    add_engine_flags(pre)
    pre.add_argument("--num-requests", type=int, default=32)
    pre.add_argument("--system-len", type=int, default=1000)
    pre.add_argument("--question-len", type=int, default=24)
    pre.add_argument("--output-len", type=int, default=4, help="answer tokens (multi-turn)")
    pre.add_argument("--conversations", type=int, default=16, help="multi-turn conversations")
    pre.add_argument("--turns", type=int, default=6, help="turns per conversation, each resending the history")

    asy = sub.add_parser("async", help="async scheduling on vs off at several batch sizes", allow_abbrev=False)
    add_engine_flags(asy)
    asy.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    asy.add_argument("--input-len", default="64:128")
    asy.add_argument("--output-len", type=int, default=64)
    asy.add_argument("--num-requests", type=int, default=1, help=argparse.SUPPRESS)

    st = sub.add_parser("structured", help="JSON-schema share 0/50/100%%, async on vs off", allow_abbrev=False)
    add_engine_flags(st)
    st.add_argument("--num-requests", type=int, default=64)
    st.add_argument("--output-len", type=int, default=128)

    for s in (o, lat, pre, asy, st):
        s.add_argument("--json", type=Path, help="also write the results here")
        s.add_argument("--skip-baseline", action="store_true", help="do not run transformers")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.num_requests < 1 or args.output_len < 1:
        raise SystemExit("--num-requests and --output-len must be >= 1")
    cfg = config_from_args(args)
    result: dict[str, Any]
    if args.bench == "offline":
        from benchmarks.offline import run as run_offline
        from benchmarks.workload import parse_range

        try:
            input_len = parse_range(args.input_len)
        except ValueError as e:
            raise SystemExit(f"--input-len: {e}") from e
        result = run_offline(cfg, args.num_requests, input_len, args.output_len, cfg.seed,
                             args.hf_batch_size, args.skip_baseline)
    elif args.bench == "async":
        from benchmarks.async_bench import run as run_async
        from benchmarks.workload import parse_range

        batches = [int(b) for b in args.batches.split(",") if b]
        result = run_async(cfg, batches, parse_range(args.input_len), args.output_len, cfg.seed)
    elif args.bench == "structured":
        from benchmarks.structured_bench import run as run_structured

        result = run_structured(cfg, args.num_requests, args.output_len, cfg.seed)
    elif args.bench == "prefix":
        from benchmarks.prefix_ttft import run as run_prefix

        if cfg.host_kv_tokens:
            from benchmarks.multiturn_host import run as run_multiturn

            if args.conversations < 1 or args.turns < 1:
                raise SystemExit("--conversations and --turns must be >= 1")
            result = run_multiturn(cfg, args.conversations, args.turns, args.system_len, args.question_len,
                                   args.output_len, cfg.seed)
        else:
            result = run_prefix(cfg, args.num_requests, args.system_len, args.question_len, cfg.seed)
    else:
        from benchmarks.latency import run as run_latency

        result = run_latency(cfg, args.prompt_len, args.output_len, args.num_requests, cfg.seed,
                             args.skip_baseline)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`tandem bench offline|latency|prefix|async|structured|spec|soak|abuse|serve`: workload flags plus every
engine flag (from tandem.launch.cli_options).

`--seed` is the engine's seed flag; the benchmarks also seed their random prompts with it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from tandem.benchmarks.soak import ENGINE_DEFAULTS as SOAK_ENGINE_DEFAULTS
from tandem.launch.cli_options import add_engine_flags, config_from_args
from tandem.protocol.serve_config import ServeConfig


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
    lat.add_argument("--llama-cpp", type=Path, help="a llama.cpp build: also run its llama-bench on the same "
                     ".gguf and print the ratio (benchmarks/llama_cpp.py)")
    lat.add_argument(
        "--llama-cpp-model",
        help="the .gguf llama-bench runs (default: --model, which must then be "
        "one), e.g. an F32 GGUF (benchmarks/gguf_to_f32.py) beside a float32 directory",
    )
    lat.add_argument("--llama-cpp-args", default="", help="more llama-bench flags, e.g. '--repack 0'")

    pre = sub.add_parser(
        "prefix",
        help="TTFT with a shared system prompt: prefix cache on vs off; with "
        "--host-kv-tokens or --host-kv-memory-gb, multi-turn conversations: host KV tier vs none",
        allow_abbrev=False,
    )
    add_engine_flags(pre)
    pre.add_argument("--num-requests", type=int, default=32)
    pre.add_argument(
        "--system-len",
        help="system prompt tokens (default 1000); multi-turn: a range LOW:HIGH, "
        "drawn per conversation (default 512:1024)",
    )
    pre.add_argument(
        "--question-len",
        help="question tokens (default 24); multi-turn: a range LOW:HIGH, drawn per turn (default 16:48)",
    )
    pre.add_argument("--output-len", type=int, default=16, help="answer tokens (multi-turn)")
    pre.add_argument("--conversations", type=int, default=16, help="multi-turn conversations")
    pre.add_argument(
        "--turns", type=int, default=6, help="turns per conversation, each resending the history"
    )
    pre.add_argument("--concurrency", type=int, default=4, help="multi-turn: requests in flight (the users "
                     "take turns round-robin)")

    lo = sub.add_parser("lora", help="streams over LoRA adapters vs the base alone (benchmarks/lora_bench.py)",
                        allow_abbrev=False)
    add_engine_flags(lo)
    lo.add_argument("--num-requests", type=int, default=32, help="concurrent streams")
    lo.add_argument("--output-len", type=int, default=64)
    lo.add_argument("--prompt-len", type=int, default=64)
    lo.add_argument("--adapters", type=int, default=4, help="random adapters the streams are spread over")
    lo.add_argument("--rank", type=int, default=16)
    lo.add_argument("--runs", type=int, default=3)
    lo.add_argument("--out", type=Path, help="write the figures (markdown, with lscpu) here")
    lo.add_argument("--json", type=Path, help="also write the results here")
    lo.add_argument("--llama-cpp", type=Path, help="a llama.cpp build: also its llama-server's one-stream "
                    "decode with the first adapter and without, on the same .gguf")

    asy = sub.add_parser(
        "async", help="async scheduling on vs off at several batch sizes", allow_abbrev=False
    )
    add_engine_flags(asy)
    asy.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    asy.add_argument("--input-len", default="64:128")
    asy.add_argument("--output-len", type=int, default=64)
    asy.add_argument("--num-requests", type=int, default=1, help=argparse.SUPPRESS)

    st = sub.add_parser(
        "structured", help="JSON-schema share 0/50/100%%, async on vs off", allow_abbrev=False
    )
    add_engine_flags(st)
    st.add_argument("--num-requests", type=int, default=64)
    st.add_argument("--output-len", type=int, default=128)

    sp = sub.add_parser("spec", help="speculative decoding on vs off, repetitive and random prompts",
                        allow_abbrev=False)
    add_engine_flags(sp)
    sp.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    sp.add_argument("--output-len", type=int, default=128)
    sp.add_argument("--num-requests", type=int, default=1, help=argparse.SUPPRESS)

    for s in (o, lat, pre, asy, st, sp):
        s.add_argument("--json", type=Path, help="also write the results here")
        s.add_argument("--skip-baseline", action="store_true", help="do not run transformers")

    so = sub.add_parser(
        "soak",
        help="minutes of mixed traffic through every door, sampled and checked (JSON + PNG); "
        "exits 1 when a check fails",
        allow_abbrev=False,
    )
    add_engine_flags(so)
    so.set_defaults(**SOAK_ENGINE_DEFAULTS)
    so.add_argument("--minutes", type=float, default=10.0)
    so.add_argument("--zmq-threads", type=int, default=8, help="Client threads")
    so.add_argument("--http-clients", type=int, default=8, help="concurrent HTTP clients")
    so.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    so.add_argument(
        "--warmup-s", type=float, help="growth is judged after this; default max(30 s, 30%% of the run)"
    )
    so.add_argument(
        "--tpot-ratio",
        type=float,
        default=2.0,
        help="p99 TPOT of the last 10%% of the run may be at most this times the first 10%%'s",
    )
    so.add_argument("--result-dir", type=Path, default=Path("benchmarks/results/soak"))
    so.add_argument("--label", default="soak", help="names the result files")

    ab = sub.add_parser("abuse", help="memory bounds under abuse at full size: unread streams, a huge body, "
                        "many grammars; each process's RSS", allow_abbrev=False)
    add_engine_flags(ab)
    ab.add_argument("--max-concurrent-requests", type=int, default=ServeConfig.max_concurrent_requests,
                    help="the HTTP door's cap (tandem serve's flag)")
    ab.add_argument("--streams", type=int, default=10_000, help="HTTP streams opened and never read")
    ab.add_argument("--stream-tokens", type=int, default=64, help="max_tokens of each unread stream")
    ab.add_argument("--body-mb", type=int, default=100, help="the over-large request body, in MiB")
    ab.add_argument(
        "--grammars", type=int, default=1000, help="distinct JSON schemas, at once then 32 at a time"
    )
    ab.add_argument("--result-dir", type=Path, default=Path("benchmarks/results/soak"))
    ab.add_argument("--label", default="abuse")

    sv = sub.add_parser("serve", help="load an OpenAI-compatible server at Poisson request rates",
                        allow_abbrev=False)
    sv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    sv.add_argument("--model", required=True, help="the model name the server serves")
    sv.add_argument(
        "--tokenizer", required=True, help="model directory or .gguf whose tokenizer makes the prompts"
    )
    sv.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    sv.add_argument("--num-prompts", type=int, default=100)
    sv.add_argument("--input-len", default="128:512", help="prompt (suffix) length range LOW:HIGH in tokens")
    sv.add_argument("--output-len", default="64:256", help="output length range LOW:HIGH in tokens")
    sv.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of each shared prefix")
    sv.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    sv.add_argument("--token-ids", action="store_true", help="send prompts as token ids instead of text")
    sv.add_argument("--request-rate", default="inf", help="comma-separated req/s; inf = all at once")
    sv.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    sv.add_argument("--slo-ttft-ms", type=float, help="goodput: a request counts if its TTFT is within this")
    sv.add_argument("--slo-tpot-ms", type=float, help="goodput: ... and its TPOT within this")
    sv.add_argument("--api-key")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--label", default="serve", help="names the result files")
    sv.add_argument("--result-dir", type=Path, help="write LABEL.json and LABEL_*.png plots here")
    sv.add_argument("--llama-cpp", type=Path, help="a llama.cpp build: also serve --llama-cpp-model with its "
                    "llama-server, send it the same requests and print the ratios")
    sv.add_argument("--llama-cpp-model", help="the .gguf llama-server serves (default: --tokenizer)")
    sv.add_argument("--llama-cpp-args", default="", help="more llama-server flags, e.g. '--no-repack'")
    return p


def _serve_main(args: argparse.Namespace) -> int:
    from tandem.benchmarks.serve_bench import run as run_serve
    from tandem.benchmarks.serve_dataset import load_tokenizer, make_requests
    from tandem.benchmarks.workload import parse_range

    try:
        rates = [float(r) for r in args.request_rate.split(",") if r]
        input_len, output_len = parse_range(args.input_len), parse_range(args.output_len)
    except ValueError as e:
        raise SystemExit(f"tandem bench serve: {e}") from e
    if args.num_prompts < 1 or not rates or any(r <= 0 for r in rates):
        raise SystemExit("tandem bench serve: --num-prompts >= 1 and request rates > 0 (or inf) needed")
    tok = load_tokenizer(args.tokenizer)
    reqs = make_requests(
        tok,
        args.dataset,
        args.num_prompts,
        input_len,
        output_len,
        args.seed,
        args.token_ids,
        args.prefix_len,
        args.num_prefixes,
    )
    results = run_serve(args.base_url, args.model, reqs, rates, args.max_concurrency, args.seed, args.api_key,
                        args.slo_ttft_ms, args.slo_tpot_ms)
    if args.llama_cpp is not None:
        from tandem.benchmarks.llama_cpp import llama_server, ratio_line, tpot_median
        from tandem.kernels.native.cpu_caps import usable_cores

        gguf = args.llama_cpp_model or args.tokenizer
        slots = args.max_concurrency or args.num_prompts
        with llama_server(args.llama_cpp, gguf, slots, input_len[1] + output_len[1] + 64, usable_cores(),
                          tuple(shlex.split(args.llama_cpp_args))) as url:
            theirs = run_serve(url, args.model, reqs, rates, args.max_concurrency, args.seed, None,
                               args.slo_ttft_ms, args.slo_tpot_ms)
        for ours_r, theirs_r in zip(results, theirs):
            rate = ours_r["request_rate"]
            print(
                ratio_line(
                    f"rate {rate}: output tok/s", ours_r["output_throughput"], theirs_r["output_throughput"]
                )
            )
            print(
                ratio_line(
                    f"rate {rate}: TPOT p50 ms",
                    ours_r["median_tpot_ms"],
                    theirs_r["median_tpot_ms"],
                    higher_is_better=False,
                )
            )
        print(ratio_line("TPOT p50 ms (median over rates)", tpot_median(results), tpot_median(theirs), False))
    if args.result_dir is not None:
        from tandem.benchmarks.serve_plots import plot

        args.result_dir.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
        path = args.result_dir / f"{args.label}.json"
        path.write_text(json.dumps({"config": config, "results": results}, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
        for p in plot(results, args.result_dir, args.label):
            print(f"wrote {p}")
    return 0


def _join_passthrough(argv: list[str]) -> list[str]:
    """`--llama-cpp-args --no-repack` as one option: argparse would read a value starting with '-' as the
    next flag, so a value that looks like flags is glued on with '='."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--llama-cpp-args":
            v = next(it, None)
            out.append(a if v is None else f"{a}={v}")
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(_join_passthrough(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.bench == "serve":
        return _serve_main(args)
    if args.bench == "abuse":
        from tandem.benchmarks.soak.abuse import run as run_abuse

        return run_abuse(
            config_from_args(args),
            args.max_concurrent_requests,
            args.streams,
            args.stream_tokens,
            args.body_mb,
            args.grammars,
            args.result_dir,
            args.label,
        )
    if args.bench == "soak":
        from tandem.benchmarks.soak.run import run as run_soak

        if args.minutes <= 0 or args.zmq_threads < 1 or args.http_clients < 1 or args.sample_s <= 0:
            raise SystemExit(
                "tandem bench soak: --minutes, --zmq-threads, --http-clients and --sample-s must be > 0"
            )
        return run_soak(
            config_from_args(args),
            args.minutes,
            args.zmq_threads,
            args.http_clients,
            args.sample_s,
            args.warmup_s,
            args.tpot_ratio,
            args.result_dir,
            args.label,
            args.seed,
        )
    if args.num_requests < 1 or args.output_len < 1:
        raise SystemExit("--num-requests and --output-len must be >= 1")
    cfg = config_from_args(args)
    result: dict[str, Any]
    if args.bench == "offline":
        from tandem.benchmarks.offline import run as run_offline
        from tandem.benchmarks.workload import parse_range

        try:
            input_len = parse_range(args.input_len)
        except ValueError as e:
            raise SystemExit(f"--input-len: {e}") from e
        result = run_offline(cfg, args.num_requests, input_len, args.output_len, cfg.seed,
                             args.hf_batch_size, args.skip_baseline)
    elif args.bench == "lora":
        from tandem.benchmarks.lora_bench import run as run_lora

        result = run_lora(cfg, args.adapters, args.rank, args.num_requests, args.prompt_len, args.output_len,
                          args.runs, args.out, args.llama_cpp)
    elif args.bench == "async":
        from tandem.benchmarks.async_bench import run as run_async
        from tandem.benchmarks.workload import parse_range

        batches = [int(b) for b in args.batches.split(",") if b]
        result = run_async(cfg, batches, parse_range(args.input_len), args.output_len, cfg.seed)
    elif args.bench == "spec":
        from tandem.benchmarks.spec_bench import run as run_spec

        batches = [int(b) for b in args.batches.split(",") if b]
        result = run_spec(cfg, batches, cfg.num_speculative_tokens, args.output_len, cfg.seed)
    elif args.bench == "structured":
        from tandem.benchmarks.structured_bench import run as run_structured

        result = run_structured(cfg, args.num_requests, args.output_len, cfg.seed)
    elif args.bench == "prefix":
        from tandem.benchmarks.prefix_ttft import run as run_prefix
        from tandem.benchmarks.workload import parse_range

        multiturn = cfg.host_tier
        try:
            system = parse_range(args.system_len or ("512:1024" if multiturn else "1000"))
            question = parse_range(args.question_len or ("16:48" if multiturn else "24"))
        except ValueError as e:
            raise SystemExit(f"--system-len/--question-len: {e}") from e
        if multiturn:
            from tandem.benchmarks.multiturn_host import run as run_multiturn

            if min(args.conversations, args.turns, args.concurrency) < 1:
                raise SystemExit("--conversations, --turns and --concurrency must be >= 1")
            result = run_multiturn(cfg, args.conversations, args.turns, system, question, args.output_len,
                                   args.concurrency, cfg.seed)
        else:
            if system[0] != system[1] or question[0] != question[1]:
                raise SystemExit("the shared-prefix benchmark takes one --system-len and one --question-len")
            result = run_prefix(cfg, args.num_requests, system[0], question[0], cfg.seed)
    else:
        from tandem.benchmarks.latency import run as run_latency

        result = run_latency(cfg, args.prompt_len, args.output_len, args.num_requests, cfg.seed,
                             args.skip_baseline, args.llama_cpp, tuple(shlex.split(args.llama_cpp_args)),
                             args.llama_cpp_model)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

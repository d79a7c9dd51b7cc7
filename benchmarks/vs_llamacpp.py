"""tandem beside llama.cpp on the files people run, in one command: the files made as llama.cpp's users make
them (benchmarks/llama_files.py: Llama-3.2-1B's shapes by default), then for each file, in the same run:

- decode: batch-1 tok/s of tandem's default (int8 activations for a quantized file, as llama.cpp's) and of
  its exact float32 products (--no-cpu-int8-activations) beside `llama-bench -n N`, with the memory roofline;
- prefill: a 512-token prompt's tokens over tandem's time to first token beside `llama-bench -p 512`;
- start: seconds from the command to /health answering, `tandem serve FILE` beside `llama-server -m FILE`;
- streams: output tok/s of S concurrent HTTP streams (64-256 tokens in, 64 out, all at once) through
  `tandem serve` beside llama-server with S slots, on this file and on the BF16 file (llama-server's best
  file is the better of the two, as issue 39 states the bar);

and `lscpu`:

    python -m tandem.benchmarks.vs_llamacpp --llama-cpp BUILD --files DIR [--types Q4_K_M Q4_0 ...]
        [--sections decode prefill start streams] [--isa avx2|avx512|avx512-vnni|avx512-bf16]

--isa measures, on this machine, what a machine of that class runs (kernels/native/cpu_caps.py): tandem's
processes start limited to it; BUILD must then be a llama.cpp built for the same class (GGML_NATIVE=OFF and
its GGML_AVX* / GGML_AMX_* options).

Prints markdown tables (and writes them with --out). Ratios only mean something on a quiet machine."""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any, get_args

from tandem.benchmarks import latency
from tandem.benchmarks.llama_cpp import _free_port, llama_bench, llama_server
from tandem.benchmarks.llama_files import TYPES, make_files
from tandem.benchmarks.server_start import learn_flags, llama_command, started, tandem_command, time_to_ready
from tandem.benchmarks.workload import random_prompts
from tandem.kernels.native.cpu_caps import CpuIsa, cpu_caps, isa_env, usable_cores
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.gguf_tensor_index import FLOAT_GGUF_TYPES

SECTIONS = ("decode", "prefill", "start", "streams")
DECODE = ("| file | llama.cpp tg | tandem default | × | roofline | tandem exact (float32 products) | × |\n"
          "|---|---|---|---|---|---|---|")
PREFILL = "| file | llama.cpp pp{n} tok/s | tandem tok/s (prompt / TTFT) | × |\n|---|---|---|---|"
START = "| file | llama-server ready s | tandem serve ready s | × (llama-server / tandem) |\n|---|---|---|---|"
STREAMS = ("| file | llama-server, this file | llama-server, BF16 file | tandem | × its best file |\n"
           "|---|---|---|---|---|")


def decode_row(name: str, default: dict[str, Any], exact: dict[str, Any] | None) -> str:
    """One decode row from latency.run results on the same file (exact: None where the default is exact)."""
    llama = default["llama_cpp"]
    cells = [name, f"{llama['tg_tok_s']:.1f} ± {llama['tg_std']:.1f}", f"{default['engine_decode_tok_s']:.1f}",
             f"{default['ratio_vs_llama_cpp']:.2f}", f"{default['roofline_fraction']:.2f}"]
    cells += (["–", "–"] if exact is None else
              [f"{exact['engine_decode_tok_s']:.1f}", f"{exact['ratio_vs_llama_cpp']:.2f}"])
    return "| " + " | ".join(cells) + " |"


def prefill(build: Path, path: Path, prompt_len: int, seed: int) -> tuple[float, float]:
    """(llama-bench pp tok/s, tandem's prompt_len / median TTFT of 3 distinct prompts) on the same file."""
    prompts = random_prompts(str(path), 4, (prompt_len, prompt_len), seed)
    eng = latency.run_engine(EngineConfig(model=str(path)), prompts, 1)
    ours = prompt_len / statistics.median(eng["ttft_s"][1:])  # the first shares the warm-up's tokens
    theirs = llama_bench(build, str(path), prompt_len, 0, usable_cores(), both_layouts=True)["pp_tok_s"]
    return theirs, ours


def streams(build: Path, path: Path, count: int, seed: int) -> float:
    """Output tok/s of `count` concurrent streams through `tandem serve` (a fresh process) on this file."""
    from tandem.benchmarks.serve_bench import run as run_serve

    reqs = _requests(path, count, seed)
    port = _free_port()
    with started(tandem_command(str(path), port), port) as (url, _):
        return run_serve(url, path.name, reqs, [math.inf], None, seed, None, None, None)[0]["output_throughput"]


def llama_streams(build: Path, path: Path, requests_of: Path, count: int, seed: int) -> float:
    """The same requests (made with `requests_of`' tokenizer) through llama-server on `path` with `count`
    slots."""
    from tandem.benchmarks.serve_bench import run as run_serve

    reqs = _requests(requests_of, count, seed)
    with llama_server(build, str(path), count, 256 + 64 + 64, usable_cores()) as url:
        return run_serve(url, path.name, reqs, [math.inf], None, seed, None, None, None)[0]["output_throughput"]


def _requests(path: Path, count: int, seed: int) -> list:
    from tandem.benchmarks.serve_dataset import load_tokenizer, make_requests

    return make_requests(load_tokenizer(str(path)), "random", count, (64, 256), (64, 64), seed, True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp build with llama-quantize")
    ap.add_argument("--files", type=Path, required=True, help="where the files are made and kept")
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0", "Q8_0", "BF16"], choices=TYPES)
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--prompt-len", type=int, default=64, help="decode: the prompt before the tokens timed")
    ap.add_argument("--output-len", type=int, default=64, help="decode: tokens timed")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--start-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isa", choices=get_args(CpuIsa), default="native",
                    help="run tandem as a machine of this class would (the engine's processes inherit it)")
    ap.add_argument("--out", type=Path, help="also write the tables here")
    args = ap.parse_args(argv)
    os.environ.update(isa_env(args.isa))
    cpu_caps.cache_clear()
    types = tuple(args.types)
    if "streams" in args.sections and "BF16" not in types:
        types += ("BF16",)  # llama-server's other candidate for its best file
    files = make_files(args.llama_cpp, args.files, types)
    tables: list[str] = []
    if "decode" in args.sections:
        lines = [DECODE]
        for name, path in files.items():
            runs = {}
            for int8 in (None, False) if name not in FLOAT_GGUF_TYPES else (None,):
                cfg = EngineConfig(model=str(path), cpu_int8_activations=int8)
                runs[int8] = latency.run(cfg, args.prompt_len, args.output_len, num_requests=3, seed=args.seed,
                                         skip_baseline=True, llama_cpp=args.llama_cpp)
            lines.append(decode_row(name, runs[None], runs.get(False)))
        tables.append("\n".join(lines))
    if "prefill" in args.sections:
        lines = [PREFILL.format(n=args.prefill_len)]
        for name, path in files.items():
            theirs, ours = prefill(args.llama_cpp, path, args.prefill_len, args.seed)
            lines.append(f"| {name} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f} |")
            print(lines[-1], flush=True)
        tables.append("\n".join(lines))
    if "start" in args.sections:
        lines = [START]
        for name, path in files.items():
            learn_flags(args.llama_cpp, str(path), usable_cores())
            ours = statistics.median(time_to_ready(lambda p, m=path: tandem_command(str(m), p), args.start_repeats))
            theirs = statistics.median(time_to_ready(
                lambda p, m=path: llama_command(args.llama_cpp, str(m), p, usable_cores()), args.start_repeats))
            lines.append(f"| {name} | {theirs:.2f} | {ours:.2f} | {theirs / ours:.2f} |")
            print(lines[-1], flush=True)
        tables.append("\n".join(lines))
    if "streams" in args.sections:
        lines = [STREAMS]
        bf16 = llama_streams(args.llama_cpp, files["BF16"], files["BF16"], args.streams, args.seed)
        for name, path in files.items():
            theirs = bf16 if name == "BF16" else llama_streams(args.llama_cpp, path, path, args.streams, args.seed)
            ours = streams(args.llama_cpp, path, args.streams, args.seed)
            lines.append(f"| {name} | {theirs:.1f} | {bf16:.1f} | {ours:.1f} | {ours / max(theirs, bf16):.2f} |")
            print(lines[-1], flush=True)
        tables.append(f"{args.streams} streams, output tok/s:\n\n" + "\n".join(lines))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    text = "\n\n".join(tables) + f"\n\n{cpu_caps().describe()}, llama.cpp {args.llama_cpp}\n\n```\n{cpu}```\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

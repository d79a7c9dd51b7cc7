"""tandem beside llama.cpp on the files people run, in one command: the files made as llama.cpp's users make
them (benchmarks/llama_files.py: Llama-3.2-1B's shapes by default), then for each, batch-1 decode of tandem
(its default: int8 activations for a quantized file, as llama.cpp's; and the exact float32 products,
--no-cpu-int8-activations) and `llama-bench tg` on the same file in the same run, with
the memory roofline measured in that run and `lscpu`:

    python -m tandem.benchmarks.vs_llamacpp --llama-cpp BUILD --files DIR [--types Q4_K_M Q4_0 ...]

Prints a markdown table (and writes it with --out). Ratios only mean something on a quiet machine."""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Any

from tandem.benchmarks import latency
from tandem.benchmarks.llama_files import TYPES, make_files
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.gguf_tensor_index import FLOAT_GGUF_TYPES

HEADER = ("| file | llama.cpp tg | tandem default | × | roofline | tandem exact (float32 products) | × |\n"
          "|---|---|---|---|---|---|---|")


def row(name: str, default: dict[str, Any], exact: dict[str, Any] | None) -> str:
    """One table row from latency.run results on the same file (exact: None where the default is exact)."""
    llama = default["llama_cpp"]
    cells = [name, f"{llama['tg_tok_s']:.1f} ± {llama['tg_std']:.1f}", f"{default['engine_decode_tok_s']:.1f}",
             f"{default['ratio_vs_llama_cpp']:.2f}", f"{default['roofline_fraction']:.2f}"]
    cells += (["–", "–"] if exact is None else
              [f"{exact['engine_decode_tok_s']:.1f}", f"{exact['ratio_vs_llama_cpp']:.2f}"])
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp build with llama-quantize")
    ap.add_argument("--files", type=Path, required=True, help="where the files are made and kept")
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0", "Q8_0", "BF16"], choices=TYPES)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    files = make_files(args.llama_cpp, args.files, tuple(args.types))
    lines = [HEADER]
    for name, path in files.items():
        runs = {}
        for int8 in (None, False) if name not in FLOAT_GGUF_TYPES else (None,):
            cfg = EngineConfig(model=str(path), cpu_int8_activations=int8)
            runs[int8] = latency.run(cfg, args.prompt_len, args.output_len, num_requests=3, seed=0,
                                     skip_baseline=True, llama_cpp=args.llama_cpp)
        lines.append(row(name, runs[None], runs.get(False)))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    text = "\n".join(lines) + "\n\n```\n" + cpu + "```\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

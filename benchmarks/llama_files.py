"""The files people run, made the way llama.cpp's users make them, at a real size: a made model (Llama-3.2-1B's
shapes by default, random weights) written by llama.cpp's own converter in BF16, F16 and F32, and requantized
from the BF16 file by its `llama-quantize` to Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K and Q8_0.

    python -m tandem.benchmarks.llama_files --llama-cpp BUILD --out DIR [--size 1b] [--types Q4_K_M BF16 ...]

BUILD is a llama.cpp build (build-llamacpp.sh's, with the `llama-quantize` target); files already in DIR are
kept. Prints one path per line."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from tandem.benchmarks.llama_convert import convert, find_converter, quantize
from tandem.launch.make_model import make_model

CONVERTED = {"BF16": "bf16", "F16": "f16", "F32": "f32"}  # llama-quantize's name -> the converter's outtype
QUANTIZED = ("Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
TYPES = (*QUANTIZED, *CONVERTED)


def make_files(build: Path, out: Path, types: tuple[str, ...] = TYPES, size: str = "1b",
               arch: str = "llama") -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    source = out / f"{arch}-{size}-hf"
    if not (source / "model.safetensors").is_file():
        make_model(arch, size, source, seed=0, tie_embeddings=True)  # tied, as Llama-3.2-1B
    converter = find_converter(build)
    files: dict[str, Path] = {}

    def converted(name: str) -> Path:
        path = out / f"{arch}-{size}-{name}.gguf"
        if not path.is_file():
            convert(source, path.with_suffix(".part"), CONVERTED[name], converter).rename(path)
        return path

    for t in types:
        if t in CONVERTED:
            files[t] = converted(t)
        elif t in QUANTIZED:
            path = out / f"{arch}-{size}-{t}.gguf"
            if not path.is_file():
                quantize(build, converted("BF16"), path.with_suffix(".part"), t, os.cpu_count() or 1).rename(path)
            files[t] = path
        else:
            raise SystemExit(f"unknown type {t!r}; choose from {', '.join(TYPES)}")
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp build with llama-quantize")
    ap.add_argument("--out", type=Path, required=True, help="where the files go (kept between runs)")
    ap.add_argument("--size", default="1b", help="a make-model size (default: Llama-3.2-1B's shapes)")
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    args = ap.parse_args(argv)
    for t, path in make_files(args.llama_cpp, args.out, tuple(args.types), args.size).items():
        print(f"{t}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The files people run, made the way llama.cpp's users make them, at a real size: a made model (Llama-3.2-1B's
shapes by default, random weights) written by llama.cpp's own converter in BF16, F16 and F32, and requantized
from the BF16 file by its `llama-quantize` to Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K and Q8_0.

    python -m tandem.benchmarks.llama_files --llama-cpp BUILD --out DIR [--size 1b] [--types Q4_K_M BF16 ...]
    python -m tandem.benchmarks.llama_files --llama-cpp BUILD --out DIR --model HF_DIR [--name NAME] \
        [--vocab-from RELEASE.gguf] [--types ...]

BUILD is a llama.cpp build (build-llamacpp.sh's, with the `llama-quantize` target); files already in DIR are
kept. --model converts a given Hugging Face directory (real weights) instead of making one; its files are
named NAME-TYPE.gguf (NAME: the directory's name by default). --vocab-from gives the converted files that
GGUF's tokenizer metadata (the same tokens: llama_convert.replace_vocab says when it is needed). Prints one
path per line."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from tandem.benchmarks.llama_convert import convert, find_converter, quantize, replace_vocab
from tandem.launch.make_model import make_model

CONVERTED = {"BF16": "bf16", "F16": "f16", "F32": "f32"}  # llama-quantize's name -> the converter's outtype
QUANTIZED = ("Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
TYPES = (*QUANTIZED, *CONVERTED)


def make_files(build: Path, out: Path, types: tuple[str, ...] = TYPES, size: str = "1b",
               arch: str = "llama", model: Path | None = None, name: str | None = None,
               vocab: Path | None = None) -> dict[str, Path]:
    """model: an HF directory to convert (else a made model of arch and size); name: the files' prefix;
    vocab: a GGUF whose tokenizer metadata the converted files take."""
    out.mkdir(parents=True, exist_ok=True)
    if model is not None:
        source, prefix = model, name or model.name
    else:
        source, prefix = out / f"{arch}-{size}-hf", name or f"{arch}-{size}"
        if not (source / "model.safetensors").is_file():
            make_model(arch, size, source, seed=0, tie_embeddings=True)  # tied, as Llama-3.2-1B
    converter = find_converter(build)
    files: dict[str, Path] = {}

    def converted(kind: str) -> Path:
        path = out / f"{prefix}-{kind}.gguf"
        if not path.is_file():
            part = convert(source, path.with_suffix(".part"), CONVERTED[kind], converter)
            if vocab is not None:
                part = replace_vocab(part, vocab, path.with_suffix(".vocab.part"), converter)
                path.with_suffix(".part").unlink()
            part.rename(path)
        return path

    for t in types:
        if t in CONVERTED:
            files[t] = converted(t)
        elif t in QUANTIZED:
            path = out / f"{prefix}-{t}.gguf"
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
    ap.add_argument("--model", type=Path, default=None, help="an HF directory to convert instead of a made model")
    ap.add_argument("--name", default=None, help="the files' name prefix (default: --model's directory name)")
    ap.add_argument("--vocab-from", type=Path, default=None, help="a GGUF whose tokenizer metadata to take")
    args = ap.parse_args(argv)
    files = make_files(args.llama_cpp, args.out, tuple(args.types), args.size, model=args.model, name=args.name,
                       vocab=args.vocab_from)
    for t, path in files.items():
        print(f"{t}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

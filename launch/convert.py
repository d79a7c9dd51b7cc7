"""`tandem convert FILE.gguf --out DIR`: the equivalent Hugging Face directory (config.json,
generation_config.json, tokenizer files with the chat template, model.safetensors in float32), loadable by
transformers and by tandem."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.protocol.architectures import architecture
from tandem.protocol.gguf_metadata import METADATA_FILES, gguf_metadata_dir, is_gguf
from tandem.protocol.model_config import read_model_config
from tandem.worker.gguf_weights import iter_gguf_weights


def convert(gguf_path: str | Path, out: str | Path) -> Path:
    if not is_gguf(gguf_path):
        raise ValueError(f"{gguf_path}: expected a .gguf file")
    out = Path(out)
    meta = gguf_metadata_dir(gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    for name in METADATA_FILES:
        shutil.copyfile(meta / name, out / name)
    # float32 holds every dequantized value exactly, so the directory and the GGUF run the same model.
    cfg = read_model_config(gguf_path)
    weights = dict(iter_gguf_weights(gguf_path, cfg, torch.float32, progress=True))
    if architecture(cfg.architecture).mixtral_experts:  # Mixtral checkpoints' own names, transformers reads
        weights = {_mixtral_name(k): v for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _mixtral_name(name: str) -> str:
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        if ".mlp.experts." in name and name.endswith(f".{ours}.weight"):
            name = name.removesuffix(f"{ours}.weight") + f"{theirs}.weight"
    return name.replace(".mlp.experts.", ".block_sparse_moe.experts.").replace(
        ".mlp.gate.", ".block_sparse_moe.gate."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem convert", description=__doc__, allow_abbrev=False)
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("--out", required=True, help="directory to write")
    args = p.parse_args(argv)
    try:
        print(convert(args.gguf, args.out))
    except ValueError as e:  # ModelLoadError included: a bad file is one line, not a traceback
        p.error(str(e))
    return 0

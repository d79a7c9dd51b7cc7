"""What every process needs to know about the model, read from its directory without torch."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec


class ModelInfo(msgspec.Struct, frozen=True):
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    architecture: str


def _as_list(x: object) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]  # type: ignore[union-attr]


def read_model_info(model_dir: str | Path, max_model_len: int | None = None) -> ModelInfo:
    d = Path(model_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{d} is not a model directory: no config.json")
    cfg = json.loads(cfg_path.read_text())
    eos = _as_list(cfg.get("eos_token_id"))
    gen_path = d / "generation_config.json"
    if gen_path.is_file():
        eos += [t for t in _as_list(json.loads(gen_path.read_text()).get("eos_token_id")) if t not in eos]
    model_max = int(cfg.get("max_position_embeddings", 2048))
    if max_model_len is not None and max_model_len > model_max:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_max}")
    return ModelInfo(
        vocab_size=int(cfg["vocab_size"]),
        max_model_len=max_model_len or model_max,
        eos_token_ids=eos,
        architecture=(cfg.get("architectures") or ["?"])[0],
    )

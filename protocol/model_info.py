"""What every process needs to know about the model (a directory or a .gguf file), without torch."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec

from protocol.model_config import metadata_dir, read_model_config


class ModelInfo(msgspec.Struct, frozen=True):
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    architecture: str
    # Keys a sliding-window layer attends (0: the model has none): the scheduler frees, per request, the
    # sliding layers' KV of positions every such layer has left behind.
    sliding_window: int = 0


def _as_list(x: object) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]  # type: ignore[union-attr]


def read_model_info(model: str | Path, max_model_len: int | None = None) -> ModelInfo:
    cfg = read_model_config(model)
    eos = _as_list(cfg.eos_token_id)
    gen_path = metadata_dir(model) / "generation_config.json"
    if gen_path.is_file():
        eos += [t for t in _as_list(json.loads(gen_path.read_text()).get("eos_token_id")) if t not in eos]
    model_max = cfg.max_position_embeddings
    if max_model_len is not None and max_model_len > model_max:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_max}")
    return ModelInfo(
        vocab_size=cfg.vocab_size,
        max_model_len=max_model_len or model_max,
        eos_token_ids=eos,
        architecture=cfg.architecture or "?",
        sliding_window=cfg.sliding_window,
    )

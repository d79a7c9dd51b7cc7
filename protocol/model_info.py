"""What every process needs to know about the model (a directory or a .gguf file), without torch."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec

from tandem.protocol.architectures import Architecture, architecture
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_config import ModelConfig, metadata_dir, read_hf_config


class ModelInfo(msgspec.Struct, frozen=True):
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    architecture: str
    hidden_size: int = 0  # an embedding's full length
    # Matryoshka models (config.json `is_matryoshka` / `matryoshka_dimensions`, as vLLM reads them) were
    # trained
    # so that a prefix of the embedding is one too: only they take an embedding request's `dimensions`.
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None  # the prefix lengths allowed; None: any
    # Keys a sliding-window layer attends (0: the model has none): the scheduler frees, per request, the
    # sliding layers' KV of positions every such layer has left behind.
    sliding_window: int = 0
    image_token_id: int | None = None  # a vision-language model's image placeholder; None: text only
    images_bidirectional: bool = False  # protocol/architectures.py's
    # an image's encoding is this many pieces, pieces_per_layer to each encoder layer (VisionConfig's)
    image_encoder_pieces: int = 0
    image_pieces_per_layer: int = 1


def _as_list(x: object) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]  # type: ignore[union-attr]


def read_model_info(model: str | Path, max_model_len: int | None = None) -> ModelInfo:
    hf = read_hf_config(model)
    cfg = ModelConfig.from_hf(hf)
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
        hidden_size=cfg.hidden_size,
        is_matryoshka=bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions")),
        matryoshka_dimensions=_as_list(hf["matryoshka_dimensions"])
        if hf.get("matryoshka_dimensions")
        else None,
        sliding_window=cfg.sliding_window,
        image_token_id=served_image_token(cfg),
        images_bidirectional=_arch(cfg.architecture).images_bidirectional,
        image_encoder_pieces=0 if cfg.vision is None else cfg.vision.encoder_pieces,
        image_pieces_per_layer=1 if cfg.vision is None else cfg.vision.pieces_per_layer,
    )


def served_image_token(cfg: ModelConfig) -> int | None:
    """The image token of a model that reads images; None: text only."""
    return None if cfg.vision is None else cfg.vision.image_token_id


def _arch(name: str | None) -> Architecture:
    try:
        return architecture(name)
    except ModelLoadError:  # read_model_info's callers reject an unknown one themselves
        return Architecture("?", "?", "?", ())

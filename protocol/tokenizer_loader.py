"""The one place a model's tokenizer is loaded, for a Hugging Face directory or a .gguf file alike (whose
tokenizer files are derived from its metadata, see protocol/gguf_metadata.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from protocol.model_config import metadata_dir


def load_tokenizer(model: str | Path) -> Any:
    """transformers' tokenizer (chat template, special tokens): for the frontend and the grammar compiler."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(metadata_dir(model)))


def load_fast_tokenizer(model: str | Path) -> Tokenizer:
    """The bare `tokenizers` object (no transformers import): for decoding in the detokenizer and stop checks."""
    return Tokenizer.from_file(str(metadata_dir(model) / "tokenizer.json"))

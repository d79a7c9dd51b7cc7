"""The one place a model's tokenizer is loaded, for a Hugging Face directory or a .gguf file alike (whose
tokenizer files are derived from its metadata, see protocol/gguf_metadata.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tandem.protocol.model_config import metadata_dir

# Classes that are the plain `tokenizer.json` tokenizer: loaded as that class directly. AutoTokenizer would
# resolve them to the same class, but its import pulls in torch (via transformers' config machinery): ~2 s
# of every engine start in the frontend and HTTP processes, which need no torch.
_PLAIN_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def _declared_class(d: Path) -> str | None:
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cfg.get("tokenizer_class") if isinstance(cfg, dict) else None


def load_tokenizer(model: str | Path) -> Any:
    """transformers' tokenizer (chat template, special tokens): for the frontend and the grammar compiler."""
    d = metadata_dir(model)
    if _declared_class(d) in _PLAIN_CLASSES and (d / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(d))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def load_fast_tokenizer(model: str | Path) -> Tokenizer:
    """The bare `tokenizers` object (no transformers import): for decoding in the detokenizer and stop
    checks."""
    return Tokenizer.from_file(str(metadata_dir(model) / "tokenizer.json"))

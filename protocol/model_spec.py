"""One model of a many-model `tandem serve`: its name, what to load and how, and how long it stays loaded.

Given with `--model` (several times: each shares the command line's engine flags) or in a TOML file
(`--models-file`), one `[[model]]` table each:

    [[model]]
    name = "chat"                  # what requests send as `model` (default: the model's own name)
    model = "smollm2-135m-instruct"  # a path, a .gguf, or a name `tandem pull` knows
    keep_alive = "10m"             # this model's idle time before it unloads (default: --keep-alive)
    pinned = true                  # loaded at start, never unloaded
    [model.options]                # engine options, as Client.launch takes them
    dtype = "float32"
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from tandem.protocol.engine_config import EngineConfig

DEFAULT_TAG = "latest"  # ollama's clients write `name:latest`; the only tag a model has here
FOREVER = -1.0  # keep_alive below zero: never unloaded for idleness
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")


def bare_name(ref: str) -> str:
    """`name:latest` -> `name` (ollama's default tag); any other text unchanged."""
    return ref[: -len(DEFAULT_TAG) - 1] if ref.endswith(":" + DEFAULT_TAG) else ref


def served_name(ref: str) -> str:
    """The name clients send for REF: a known or pulled name as written (without `:latest`), else the file's
    or directory's name (a pulled `NAME/model.gguf` is NAME)."""
    if os.sep not in ref and not Path(ref).exists():
        return bare_name(ref)
    p = Path(os.path.normpath(ref))
    if p.name == "model.gguf" and p.parent.name:
        return p.parent.name
    return p.name


def parse_keep_alive(v: object) -> float:
    """Seconds, from ollama's forms: a number of seconds, a Go duration ("30s", "5m", "1h30m", "-1m"),
    or a numeric string; any negative value means forever (FOREVER). ValueError names the value."""
    if isinstance(v, bool):
        raise ValueError(f"invalid keep_alive {v!r}: give a duration such as 30s, 5m, 1h or seconds")
    if isinstance(v, (int, float)):
        return FOREVER if v < 0 else float(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            return parse_keep_alive(float(s))
        except ValueError:
            pass
        sign, body = (-1.0, s[1:]) if s.startswith("-") else (1.0, s.lstrip("+"))
        if body and _PART.sub("", body) == "" and _PART.match(body):
            secs = sum(float(n) * _UNITS[u] for n, u in _PART.findall(body))
            return FOREVER if sign < 0 and secs > 0 else secs
    raise ValueError(f"invalid keep_alive {v!r}: give a duration such as 30s, 5m, 1h or seconds")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model: str  # as written: a path or a known name (resolved when the engine starts)
    options: dict[str, Any] = field(default_factory=dict)  # EngineConfig's options
    keep_alive_s: float | None = None  # None: the server's --keep-alive
    pinned: bool = False

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"invalid model name {self.name!r}: give a name without spaces")
        EngineConfig.from_options(self.model, **self.options)  # unknown or bad options fail at start


_TABLE_KEYS = {"name", "model", "options", "keep_alive", "pinned"}


def read_models_file(path: str | Path) -> list[ModelSpec]:
    """The `[[model]]` tables of a TOML file; ValueError names the table and key at fault."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"models file {path}: {e}") from e
    extra = set(doc) - {"model"}
    tables = doc.get("model")
    if extra or not isinstance(tables, list) or not tables:
        raise ValueError(f"models file {path}: give one or more [[model]] tables and nothing else"
                         + (f" (found {', '.join(sorted(extra))})" if extra else ""))
    specs = []
    for i, t in enumerate(tables):
        where = f"models file {path}, [[model]] #{i + 1}"
        unknown = set(t) - _TABLE_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(_TABLE_KEYS))}")
        if not isinstance(t.get("model"), str):
            raise ValueError(f"{where}: `model` (a path or a known name) is required")
        opts = t.get("options", {})
        if not isinstance(opts, dict):
            raise ValueError(f"{where}: `options` must be a table")
        try:
            keep = None if "keep_alive" not in t else parse_keep_alive(t["keep_alive"])
            specs.append(ModelSpec(str(t.get("name") or served_name(t["model"])), t["model"], dict(opts),
                                   keep, bool(t.get("pinned", False))))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"models file {path}: model name(s) given twice: {', '.join(dup)}")
    return specs

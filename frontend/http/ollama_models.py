"""A model as ollama's API lists it: /api/tags' and /api/ps' entries (`ollama_model_entry`, which the
many-model router calls too) and /api/show's answer, from the model's file or directory and its config.

What is read is cheap and read once per file version (path, size, modification time): the sizes and times
of the files, the safetensors headers (the tensors' shapes), a GGUF file's cached tensor index, config.json.
The digest is a hash of the path, size and time, not of the weights."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from tandem.protocol.gguf_metadata import is_gguf, metadata_cache_path
from tandem.protocol.gguf_tensor_index import INDEX_FILE
from tandem.protocol.model_config import ModelConfig, read_hf_config
from tandem.protocol.model_info import ModelInfo

DEFAULT_TAG = "latest"
NEVER_S = 10 * 365 * 86400.0  # /api/ps' expires_at for a model that never unloads (ollama shows a far date)
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def rfc3339(t: float | None = None) -> str:
    """A time (default now) as ollama writes it: RFC 3339, UTC."""
    at = datetime.now(timezone.utc) if t is None else datetime.fromtimestamp(t, timezone.utc)
    return at.isoformat().replace("+00:00", "Z")


def never_expires() -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=NEVER_S)).isoformat().replace("+00:00", "Z")


def tagged(name: str) -> str:
    """`name:latest` unless the name has a tag already (ollama's clients list and send names so)."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{DEFAULT_TAG}"


@dataclass(frozen=True)
class _Facts:
    size: int
    mtime: float
    digest: str
    format: str  # "gguf" or "safetensors"
    family: str
    parameter_count: int | None
    quantization: str
    config: dict[str, Any] = field(default_factory=dict)


def _files(p: Path) -> list[Path]:
    return [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]


def _facts(model_path: str) -> _Facts | None:
    """What is known of the model on disk (None: no such file or directory, e.g. a model not pulled yet)."""
    p = Path(model_path).resolve()
    if not p.exists():
        return None
    stats = [f.stat() for f in _files(p)]
    size = sum(s.st_size for s in stats)
    mtime_ns = max((s.st_mtime_ns for s in stats), default=0)
    index = None
    if is_gguf(p):
        try:
            index = metadata_cache_path(p) / INDEX_FILE
        except OSError:
            index = None
    # Keyed on the index's presence too: an engine that writes it later brings the counts it holds.
    return _read_facts(str(p), size, mtime_ns, index is not None and index.is_file())


@functools.lru_cache(maxsize=256)
def _read_facts(path: str, size: int, mtime_ns: int, has_index: bool) -> _Facts:
    p = Path(path)
    try:
        hf = read_hf_config(p)
    except Exception:  # not a model tandem reads: listed by its file facts alone
        hf = {}
    family = str(hf.get("model_type") or "")
    digest = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()
    if is_gguf(p):
        count, quant = _gguf_counts(p) if has_index else (None, "")
        return _Facts(size, mtime_ns / 1e9, digest, "gguf", family, count, quant, hf)
    qc = hf.get("quantization_config") or {}
    dtype = _DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype")), "")
    quant = str(qc.get("quant_method") or "").upper() or dtype
    return _Facts(size, mtime_ns / 1e9, digest, "safetensors", family, _safetensors_count(p), quant, hf)


def _safetensors_count(d: Path) -> int | None:
    """The parameters in a directory's safetensors files, from their headers (the tensors' shapes)."""
    total, found = 0, False
    for f in sorted(d.glob("*.safetensors")) if d.is_dir() else []:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return None
        found = True
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total if found else None


def _gguf_counts(p: Path) -> tuple[int | None, str]:
    """(parameters, the linear weights' type) from a GGUF file's cached tensor index (tensor_index.py)."""
    try:
        entries = json.loads((metadata_cache_path(p) / INDEX_FILE).read_text(encoding="utf-8"))["tensors"]
    except (OSError, ValueError, KeyError):
        return None, ""
    count = sum(math.prod(e[2]) for e in entries)
    linear = next((e[1] for e in entries if e[0] == "blk.0.attn_output.weight"), None)
    linear = linear or next((e[1] for e in entries if e[0].startswith("blk.") and len(e[2]) == 2), "")
    return count, linear


def human_number(n: int) -> str:
    """ollama's way of writing a parameter count: 8.0B, 134.52M, 12K."""
    for unit, div, places in (("B", 1e9, 1), ("M", 1e6, 2)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == math.floor(v) else f"{v:.{places}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)


def _details(f: _Facts | None, info: ModelInfo | None) -> dict[str, Any]:
    family = (f.family if f else "") or (info.architecture if info else "")
    count = f.parameter_count if f else None
    return {"parent_model": "", "format": f.format if f else "", "family": family,
            "families": [family] if family else None,
            "parameter_size": human_number(count) if count is not None else "",
            "quantization_level": f.quantization if f else ""}


def ollama_model_entry(name: str, model_path: str, info: ModelInfo | None, expires_at: str | None) -> dict:
    """One model as /api/tags lists it, or /api/ps when `expires_at` is given (RFC 3339; with size_vram 0:
    tandem does not say where weights lie). `info` None: the model is not on disk yet (listed by name)."""
    f = _facts(model_path)
    out: dict[str, Any] = {
        "name": tagged(name), "model": tagged(name),
        "modified_at": rfc3339(f.mtime) if f else "0001-01-01T00:00:00Z",  # Go's zero time, as ollama's
        "size": f.size if f else 0,
        "digest": f.digest if f else "",
        "details": _details(f, info),
    }
    if expires_at is not None:
        out["expires_at"] = expires_at
        out["size_vram"] = 0
        if info is not None:
            out["context_length"] = info.max_model_len
    return out


def chat_template(tokenizer: Any) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # named templates: the default one is the chat's
        t = t.get("default")
    return t if isinstance(t, str) else ""


def _model_info(f: _Facts | None, info: ModelInfo) -> dict[str, Any]:
    arch = (f.family if f else "") or info.architecture
    out: dict[str, Any] = {"general.architecture": arch}
    if f is not None and f.parameter_count is not None:
        out["general.parameter_count"] = f.parameter_count
    out[f"{arch}.context_length"] = info.max_model_len
    out[f"{arch}.embedding_length"] = info.hidden_size
    out[f"{arch}.vocab_size"] = info.vocab_size
    try:
        cfg = ModelConfig.from_hf(f.config) if f is not None and f.config else None
    except Exception:
        cfg = None
    if cfg is not None:
        out.update({
            f"{arch}.block_count": cfg.num_hidden_layers,
            f"{arch}.attention.head_count": cfg.num_attention_heads,
            f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
            f"{arch}.attention.key_length": cfg.head_dim,
            f"{arch}.feed_forward_length": cfg.intermediate_size,
            f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
            f"{arch}.rope.freq_base": cfg.rope_theta,
        })
    if info.eos_token_ids:
        out["tokenizer.ggml.eos_token_id"] = info.eos_token_ids[0]
    return out


def ollama_show(name: str, model_path: str, info: ModelInfo, tokenizer: Any, thinks: bool) -> dict:
    """POST /api/show's answer. `template` is the model's own chat template (Jinja, not ollama's Go
    templates); `capabilities`: completion and embedding always, tools when the template takes them,
    thinking when the server separates the model's reasoning, vision when it reads images."""
    f = _facts(model_path)
    template = chat_template(tokenizer)
    caps = ["completion"] + (["tools"] if "tools" in template else []) + (["thinking"] if thinks else [])
    caps += ["vision"] if info.image_token_id is not None else []
    parameters = f"{'num_ctx':<30} {info.max_model_len}"
    modelfile = (f'# Modelfile generated by "tandem" for {tagged(name)}\n'
                 "# The chat template is the model's own (Jinja): see `template`.\n"
                 f"FROM {model_path}\nPARAMETER num_ctx {info.max_model_len}\n")
    return {"modelfile": modelfile, "parameters": parameters, "template": template,
            "details": _details(f, info), "model_info": _model_info(f, info),
            "capabilities": [*caps, "embedding"],
            "modified_at": rfc3339(f.mtime) if f else "0001-01-01T00:00:00Z"}

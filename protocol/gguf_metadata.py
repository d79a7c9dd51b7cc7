"""A GGUF file's metadata as the Hugging Face files the engine reads: config.json, generation_config.json,
tokenizer.json and tokenizer_config.json (with the chat template).

gguf's reader parses every metadata field (a 49k-token vocabulary takes it seconds) and transformers'
GGUF tokenizer conversion takes longer still, so the files are written once per GGUF file into a cache
directory and every process reads them from there.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.protocol.architectures import Architecture, gguf_architecture
from tandem.protocol.errors import ModelLoadError

if TYPE_CHECKING:
    from gguf import GGUFReader

METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
CACHE_ENV = "TANDEM_CACHE_DIR"


def is_gguf(model: str | Path) -> bool:
    return str(model).endswith(".gguf")


def open_gguf(path: str | Path) -> GGUFReader:
    """gguf's reader, with whatever it raises on a broken file turned into one ModelLoadError."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{p}: no such GGUF file")
    try:
        return GGUFReader(p)
    except (ValueError, IndexError, KeyError, TypeError, OSError) as e:
        # Wrong magic, a truncated header or tensor data past the end of the file all land here.
        raise ModelLoadError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader: GGUFReader, path: str | Path) -> dict[str, Any]:
    """The config.json transformers would write for this model."""
    import gguf

    tensors = {t.name: t for t in reader.tensors}
    # The architecture's registry entry (a "llama" file with expert tensors is Mixtral's: llama.cpp writes
    # it so) says what the common fields below leave out.
    entry = gguf_architecture(
        _field(reader, "general.architecture"), path, moe=any(n.endswith("_exps.weight") for n in tensors)
    )
    arch = entry.gguf_arch
    K = gguf.Keys

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, key.format(arch=arch), default)

    def need(key: str) -> int:
        v = meta(key)
        if v is None:
            raise ModelLoadError(f"{path}: metadata key {key.format(arch=arch)!r} is missing")
        return int(v)

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    hidden, heads = need(K.LLM.EMBEDDING_LENGTH), need(K.Attention.HEAD_COUNT)
    experts = _experts(reader, path, entry, tensors)
    cfg: dict[str, Any] = {
        "architectures": [entry.name],
        "model_type": entry.model_type,
        # The embedding's rows, not the token list: a padded vocabulary has more rows than tokens.
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "num_hidden_layers": need(K.LLM.BLOCK_COUNT),
        "intermediate_size": need(K.LLM.FEED_FORWARD_LENGTH) if not experts or meta(K.LLM.FEED_FORWARD_LENGTH)
        else experts["moe_intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta(K.Attention.HEAD_COUNT_KV, heads)),
        "head_dim": int(meta(K.Attention.KEY_LENGTH, hidden // heads)),
        # Stored as float32: 7 significant digits give back the decimal the model was published with.
        "rms_norm_eps": float(f"{meta(K.Attention.LAYERNORM_RMS_EPS, 1e-6):.7g}"),
        "rope_theta": float(meta(K.Rope.FREQ_BASE, 10000.0)),
        "max_position_embeddings": int(meta(K.LLM.CONTEXT_LENGTH, 2048)),
        # llama.cpp's converters drop output.weight when the LM head is the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "bos_token_id": meta(K.Tokenizer.BOS_ID),
        "eos_token_id": meta(K.Tokenizer.EOS_ID),
        "torch_dtype": "float32",
    }
    for name, tensor in entry.gguf_tensor_flags.items():
        cfg[name] = tensor in tensors
    if experts:
        if entry.mixtral_experts:  # every layer's experts are intermediate_size wide
            cfg["intermediate_size"] = experts["moe_intermediate_size"]
            experts["num_local_experts"] = experts.pop("num_experts")
        cfg.update(experts)
    if entry.gguf_config is not None:
        cfg.update(entry.gguf_config(meta, cfg, path))
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style frequency factors are stored as a tensor, not as parameters we can rebuild.
        raise ModelLoadError(f"{path}: per-frequency RoPE factors (rope_freqs.weight) are not supported")
    scaling = meta(K.Rope.SCALING_TYPE, "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta(K.Rope.SCALING_FACTOR, 1.0))}
    elif scaling != "none":
        raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported (only linear)")
    return cfg


def _experts(
    reader: GGUFReader, path: str | Path, entry: Architecture, tensors: dict[str, Any]
) -> dict[str, Any]:
    """The MoE fields of config.json ({} for a dense file), checked against the expert tensors: each layer's
    ffn_*_exps must hold expert_count experts (a layer without them is a dense one)."""
    import gguf

    def key(k: str) -> str:
        return k.format(arch=entry.gguf_arch)

    count = _field(reader, key(gguf.Keys.LLM.EXPERT_COUNT))
    if not count:
        if any(n.endswith("_exps.weight") for n in tensors):
            raise ModelLoadError(
                f"{path}: expert tensors but no {key(gguf.Keys.LLM.EXPERT_COUNT)!r} in the metadata"
            )
        return {}
    count, used = int(count), int(_field(reader, key(gguf.Keys.LLM.EXPERT_USED_COUNT), 0))
    if not 0 < used <= count:
        raise ModelLoadError(f"{path}: {key(gguf.Keys.LLM.EXPERT_USED_COUNT)} = {used} must be between 1 and "
                             f"{key(gguf.Keys.LLM.EXPERT_COUNT)} = {count}")
    layers = int(_field(reader, key(gguf.Keys.LLM.BLOCK_COUNT), 0))
    dense, width = [], None
    for i in range(layers):
        exps = [tensors.get(f"blk.{i}.ffn_{w}_exps.weight") for w in ("gate", "up", "down")]
        if all(t is None for t in exps):
            dense.append(i)
            continue
        for t, w in zip(exps, ("gate", "up", "down")):
            if t is None or len(t.shape) != 3 or int(t.shape[2]) != count:
                got = "none" if t is None else f"shape {[int(d) for d in t.shape]}"
                raise ModelLoadError(
                    f"{path}: {key(gguf.Keys.LLM.EXPERT_COUNT)} = {count} does not match tensor "
                    f"blk.{i}.ffn_{w}_exps.weight ({got})"
                )
        width = int(exps[0].shape[1])
    ffn = _field(reader, key(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH))
    shared = _field(reader, key(gguf.Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH))
    norm = _field(reader, key(gguf.Keys.LLM.EXPERT_WEIGHTS_NORM))
    return {
        "num_experts": count,
        "num_experts_per_tok": used,
        "moe_intermediate_size": int(ffn) if ffn else width,
        # as llama.cpp runs the architecture when the file does not say
        "norm_topk_prob": bool(entry.gguf_norm_topk if norm is None else norm),
        "shared_expert_intermediate_size": int(shared or 0),
        "mlp_only_layers": dense,
    }


def generation_config(reader: GGUFReader) -> dict[str, Any]:
    import gguf

    T = gguf.Keys.Tokenizer
    # llama.cpp ends generation at end-of-turn and end-of-message tokens too (chat models set them).
    ends = [_field(reader, k) for k in (T.EOS_ID, T.EOT_ID, T.EOM_ID)]
    eos = list(dict.fromkeys(t for t in ends if t is not None))
    return {"bos_token_id": _field(reader, T.BOS_ID), "eos_token_id": eos}


def write_metadata(path: str | Path, out: str | Path) -> None:
    """Write METADATA_FILES for the GGUF at `path` into `out`."""
    from transformers import AutoTokenizer

    p, out = Path(path), Path(out)
    reader = open_gguf(p)
    cfg = hf_config(reader, p)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(generation_config(reader), indent=2) + "\n")
    from tandem.protocol.gguf_tensor_index import write_tensor_index

    write_tensor_index(reader, out)  # the worker's start then needs no parse of its own
    del reader  # its memory map: the tokenizer below reads the file again
    try:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"{p}: cannot build a tokenizer from its metadata ({e})") from None
    tok.model_max_length = cfg["max_position_embeddings"]
    # tokenizer_config.json keeps the chat template (older transformers read it only from there).
    tok.save_pretrained(str(out), save_jinja_files=False)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8"))
    # The class name every transformers version knows; the rest is where this copy was loaded from.
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("is_local", "local_files_only"):
        tc.pop(k, None)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tandem")


@functools.cache
def reader_code() -> str:
    """A hash of the code that writes the metadata files: this module, the architectures' entries (their
    GGUF readers) and the tensor index."""
    here = Path(__file__).parent
    names = ("gguf_metadata.py", "architectures.py", "gguf_gemma3.py", "gguf_tensor_index.py")
    return hashlib.sha256(b"".join((here / n).read_bytes() for n in names)).hexdigest()[:16]


def metadata_cache_path(path: str | Path) -> Path:
    """Where gguf_metadata_dir keeps a GGUF file's METADATA_FILES. The key is the file's path, size and
    modification time, so a replaced file gets fresh metadata, and the reader's own code, so a fixed reader
    does too."""
    p = Path(path).resolve()
    if not p.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    st = p.stat()
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{reader_code()}".encode()).hexdigest()[:20]
    return cache_root() / "gguf" / f"{p.stem}-{key}"


def gguf_metadata_dir(path: str | Path) -> Path:
    """The cached METADATA_FILES of a GGUF file, written on first use."""
    p = Path(path).resolve()
    d = metadata_cache_path(p)
    if all((d / f).is_file() for f in METADATA_FILES):
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=d.parent))
    try:
        write_metadata(p, tmp)
        try:
            tmp.rename(d)  # atomic: a process racing us either sees no directory or a complete one
        except OSError:
            if not all((d / f).is_file() for f in METADATA_FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d

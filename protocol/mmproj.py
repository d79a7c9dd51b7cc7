"""A GGUF text model with llama.cpp's multimodal projector file (`--mmproj`, as llama.cpp and ollama ship
vision models): the two made into one model directory the rest of the engine reads as any other.

The directory (cached, like a GGUF's metadata) holds the text file's metadata with a vision-language
config.json (the projector's `clip.vision.*` metadata as the vision config, the image tokens from the
text file's vocabulary), the image processor's config and the chat template, and links to both files
(`model.gguf`, `mmproj.gguf`), from which worker/loader.py reads the weights (the text file's quantized
blocks kept as for a GGUF alone). Gemma 3's projector (`clip.projector_type` gemma3) is the one read.

No torch import: the launcher builds the directory before any process starts.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tandem.protocol.errors import ModelLoadError
from tandem.protocol.gguf_metadata import gguf_metadata_dir, metadata_cache_path, open_gguf

TEXT_FILE, PROJECTOR_FILE = "model.gguf", "mmproj.gguf"
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")  # boi, image, eoi


def projector_file(model_dir: str | Path) -> Path | None:
    """The projector a directory made here links to (None: not such a directory)."""
    p = Path(model_dir) / PROJECTOR_FILE
    return p if p.exists() and (Path(model_dir) / TEXT_FILE).exists() else None


def _meta(reader: Any) -> dict[str, Any]:
    out = {}
    for k, f in reader.fields.items():
        if not k.startswith("GGUF."):
            try:
                out[k] = f.contents()
            except Exception:  # a field gguf-py cannot read: not one used here
                continue
    return out


def _vision_config(mmproj: Path) -> tuple[dict[str, Any], int, tuple[list[float], list[float]]]:
    m = _meta(open_gguf(mmproj))
    if m.get("general.architecture") != "clip" or not m.get("clip.has_vision_encoder"):
        raise ModelLoadError(f"{mmproj}: not a multimodal projector file (llama.cpp's mmproj GGUF)")
    kind = m.get("clip.projector_type")
    if kind != "gemma3":
        raise ModelLoadError(f"{mmproj}: projector type {kind!r} is not served (gemma3 is)")

    def need(key: str) -> Any:
        if f"clip.vision.{key}" not in m:
            raise ModelLoadError(f"{mmproj}: metadata clip.vision.{key} is missing")
        return m[f"clip.vision.{key}"]

    size, patch = int(need("image_size")), int(need("patch_size"))
    pool = int(m.get("clip.vision.projector.scale_factor", 4))
    side = size // patch // pool
    vision = {
        "model_type": "siglip_vision_model", "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": int(need("attention.head_count")), "image_size": size, "patch_size": patch,
        "layer_norm_eps": float(need("attention.layer_norm_epsilon")), "num_channels": 3,
        "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False,
    }
    mean = [float(x) for x in m.get("clip.vision.image_mean", [0.5] * 3)]
    std = [float(x) for x in m.get("clip.vision.image_std", [0.5] * 3)]
    return vision, side * side, (mean, std)


def _stamp(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:20]


def projector_model_dir(text_gguf: str | Path, mmproj: str | Path) -> Path:
    """The model directory of text_gguf + mmproj, written on first use."""
    text, proj = Path(text_gguf).resolve(), Path(mmproj).resolve()
    for f in (text, proj):
        if not f.is_file():
            raise ModelLoadError(f"{f}: no such file")
    # keyed by both files and the code that writes it (this module's, the text metadata's)
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8] + metadata_cache_path(text).name[-8:]
    d = metadata_cache_path(text).parent.parent / "mmproj" / f"{text.stem}-{_stamp(text, proj)}{code}"
    if (d / "config.json").is_file():
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=d.parent))
    try:
        _write(text, proj, tmp)
        try:
            tmp.rename(d)  # atomic: a racing process sees nothing or all of it
        except OSError:
            if not (d / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def _write(text: Path, proj: Path, out: Path) -> None:
    meta = gguf_metadata_dir(text)
    text_cfg = json.loads((meta / "config.json").read_text(encoding="utf-8"))
    if text_cfg.get("model_type") != "gemma3_text":
        raise ModelLoadError(f"{text}: a {text_cfg.get('model_type')!r} text model; the gemma3 projector "
                             "goes with a Gemma 3 text file")
    tokens = list(_meta(open_gguf(text)).get("tokenizer.ggml.tokens", []))
    missing = [t for t in GEMMA3_IMAGE_TOKENS if t not in tokens]
    if missing:
        raise ModelLoadError(f"{text}: its vocabulary has no {', '.join(missing)}: not a Gemma 3 that reads "
                             "images")
    boi, image, eoi = (tokens.index(t) for t in GEMMA3_IMAGE_TOKENS)
    vision, n_tokens, (mean, std) = _vision_config(proj)
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text_cfg, "vision_config": vision, "mm_tokens_per_image": n_tokens,
        "image_token_index": image, "boi_token_index": boi, "eoi_token_index": eoi,
        "tie_word_embeddings": text_cfg.get("tie_word_embeddings", True),
        "bos_token_id": text_cfg.get("bos_token_id"), "eos_token_id": text_cfg.get("eos_token_id"),
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for f in ("generation_config.json", "tokenizer.json"):
        shutil.copyfile(meta / f, out / f)
    tok = json.loads((meta / "tokenizer_config.json").read_text(encoding="utf-8"))
    special = dict(zip(("boi_token", "image_token", "eoi_token"), GEMMA3_IMAGE_TOKENS, strict=True))
    tok.update(special, model_specific_special_tokens=special, processor_class="Gemma3Processor")
    template = tok.get("chat_template")
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=2), encoding="utf-8")
    if template:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    size = vision["image_size"]
    processor = {
        "image_processor": {
            "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": True, "do_normalize": True,
            "do_pan_and_scan": False, "do_rescale": True, "do_resize": True, "image_mean": mean,
            "image_std": std, "resample": 2, "rescale_factor": 1 / 255,
            "size": {"height": size, "width": size},
        },
        "image_seq_length": n_tokens, "processor_class": "Gemma3Processor",
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2), encoding="utf-8")
    os.symlink(text, out / TEXT_FILE)
    os.symlink(proj, out / PROJECTOR_FILE)

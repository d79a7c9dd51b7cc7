"""GGUF files written from the tiny made models with gguf's own writer, the way llama.cpp's converter lays
them out (llama's Q/K rows permuted, norms and biases kept in F32, 2-D weights in the chosen type)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file
from transformers import AutoConfig

QTYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q4_K": gguf.GGMLQuantizationType.Q4_K,  # random blocks: gguf cannot quantize to it (see q4_k_blocks)
}


def q4_k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks for a [rows, cols] weight (cols a multiple of 256): any bytes are a valid block
    given finite scales; d and dmin small, so the weights stay within about +-0.05."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        raw[..., at : at + 2] = rng.uniform(1e-5, 1e-4, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama's q_proj/k_proj rows: each head's two halves
    (rotate-half RoPE) become interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_metadata(w: gguf.GGUFWriter, model_dir: Path) -> None:
    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(tj["model"]["vocab"])
    special = {t["id"] for t in tj["added_tokens"] if t.get("special")}
    vocab.update({t["content"]: t["id"] for t in tj["added_tokens"]})
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    tc = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    gen = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    w.add_eos_token_id(eos[0])
    if len(eos) > 1:  # a chat model's end of turn: llama.cpp's converter stores it as EOT
        w.add_eot_token_id(eos[1])
    w.add_add_bos_token(False)
    w.add_chat_template(tc["chat_template"])


def write_gguf(
    model_dir: Path,
    out: Path,
    qtype: str = "F32",
    arch: str | None = None,
    override: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `model_dir` as a GGUF file. arch: the GGUF architecture name to claim (default: the model's);
    override: GGUF tensor name -> array written instead (any dtype the writer accepts)."""
    cfg = AutoConfig.from_pretrained(model_dir)
    real_arch = cfg.model_type
    arch = arch or real_arch
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(theta)
    _tokenizer_metadata(w, model_dir)

    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == real_arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    q = QTYPES[qtype]
    for hf_name, t in load_file(str(model_dir / "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        t = t.astype(np.float32)
        if real_arch == "llama" and ".q_proj." in hf_name:
            t = llamacpp_permute(t, heads)
        elif real_arch == "llama" and ".k_proj." in hf_name:
            t = llamacpp_permute(t, kv_heads)
        if override and name in override:
            w.add_tensor(name, override[name])
        elif t.ndim == 1 or qtype == "F32":
            w.add_tensor(name, t)
        elif qtype == "F16":
            w.add_tensor(name, t.astype(np.float16))
        elif qtype == "Q4_K":
            w.add_tensor(name, q4_k_blocks(*t.shape, seed=len(name) + t.size), raw_dtype=q)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

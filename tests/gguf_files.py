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
    "Q5_0": gguf.GGMLQuantizationType.Q5_0,
    "Q5_1": gguf.GGMLQuantizationType.Q5_1,
    # random blocks: gguf cannot quantize to the K-quants (see k_quant_blocks)
    "Q4_K": gguf.GGMLQuantizationType.Q4_K,
    "Q5_K": gguf.GGMLQuantizationType.Q5_K,
    "Q6_K": gguf.GGMLQuantizationType.Q6_K,
}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# Files of several types, as llama.cpp's converter mixes them (see mixed_type).
MIXES = ("Q4_K_M", "Q5_K_M")

# K-quant -> (byte offsets of its float16 super-block scales, their range): any other bytes make a valid
# block, and these ranges keep the weights within about +-0.05 (the sub-block scales reach 63, or +-128
# for Q6_K; q reaches 15, 31, or +-32).
_K_SCALES = {"Q4_K": ((0, 2), (1e-5, 1e-4)), "Q5_K": ((0, 2), (5e-6, 5e-5)), "Q6_K": ((208,), (1e-6, 1e-5))}


def k_quant_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a K-quant (Q4_K, Q5_K, Q6_K) for a [rows, cols] weight (cols a multiple of 256)."""
    rng = np.random.default_rng(seed)
    size = gguf.GGML_QUANT_SIZES[QTYPES[qtype]][1]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    ats, (lo, hi) = _K_SCALES[qtype]
    for at in ats:
        raw[..., at : at + 2] = rng.uniform(lo, hi, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def mixed_type(mix: str, name: str) -> str:
    """A tensor's type in a Q4_K_M or Q5_K_M file of the 4-layer "small" models: Q4_K (Q5_K), and as
    llama.cpp's mixes do, Q6_K for the output and for attn_v and ffn_down in some layers (here the first
    and the last), so a layer's fused q/k/v has two types. Q5_0 (Q5_1) stands for the type such a file falls
    back to for a tensor whose rows are not whole 256-blocks (here an attn_k), Q8_0 for the embedding (the
    tied models' LM head) and an attn_q."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (name.endswith(("attn_v.weight", "ffn_down.weight")) and layer in (0, 3)):
        return "Q6_K"
    if name == "token_embd.weight" or (name.endswith("attn_q.weight") and layer == 2):
        return "Q8_0"
    if name.endswith("attn_k.weight") and layer == 1:
        return {"Q4_K_M": "Q5_0", "Q5_K_M": "Q5_1"}[mix]
    return {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}[mix]


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
    """Write `model_dir` as a GGUF file. qtype: one of QTYPES or MIXES; arch: the GGUF architecture name to
    claim (default: the model's); override: GGUF tensor name -> array written instead (any dtype the writer accepts)."""
    cfg = AutoConfig.from_pretrained(model_dir)
    real_arch = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
    arch = arch or real_arch
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type
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
    if real_arch == "gemma3":  # what llama.cpp's converter writes for Gemma 3
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        if cfg.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    _tokenizer_metadata(w, model_dir)

    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == real_arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for hf_name, t in load_file(str(model_dir / "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        t = t.astype(np.float32)
        if real_arch == "gemma3" and hf_name.endswith("norm.weight"):
            t = t + np.float32(1)  # llama.cpp stores Gemma's RMSNorm scale 1 + w
        if real_arch == "llama" and ".q_proj." in hf_name:
            t = llamacpp_permute(t, heads)
        elif real_arch == "llama" and ".k_proj." in hf_name:
            t = llamacpp_permute(t, kv_heads)
        qt = mixed_type(qtype, name) if qtype in MIXES else qtype
        if override and name in override:
            w.add_tensor(name, override[name])
        elif t.ndim == 1 or qt == "F32":
            w.add_tensor(name, t)
        elif qt == "F16":
            w.add_tensor(name, t.astype(np.float16))
        elif qt in K_QUANTS:
            w.add_tensor(name, k_quant_blocks(qt, *t.shape, seed=len(name) + t.size), raw_dtype=QTYPES[qt])
        else:
            w.add_tensor(name, gguf.quants.quantize(t, QTYPES[qt]), raw_dtype=QTYPES[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

"""GGUF files written from the tiny made models with gguf's own writer, the way llama.cpp's converter lays
them out (llama's Q/K rows permuted, norms and biases kept in F32, 2-D weights in the chosen type)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file
from transformers import AutoConfig

QTYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
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
    w.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    w.add_eos_token_id(eos[0])
    if len(eos) > 1:  # a chat model's end of turn: llama.cpp's converter stores it as EOT
        w.add_eot_token_id(eos[1])
    w.add_add_bos_token(False)
    w.add_chat_template(tc["chat_template"])


# HF model_type -> llama.cpp's architecture name (Mixtral is a "llama" file with expert tensors).
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "gemma3_text": "gemma3"}
_EXPERT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A checkpoint's per-expert tensors as llama.cpp's [E, rows, inputs] stacks, under the HF module name
    gguf's map knows (model.layers.N.mlp.experts.gate_proj.weight)."""
    out, stacks = {}, {}
    for name, t in weights.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault(f"{m[1]}.mlp.experts.{_EXPERT_NAMES.get(m[3], m[3])}.weight", {})[int(m[2])] = t
    for name, per in stacks.items():
        out[name] = np.stack([per[e] for e in range(len(per))])
    return out


def write_gguf(
    model_dir: Path,
    out: Path,
    qtype: str = "F32",
    arch: str | None = None,
    override: dict[str, np.ndarray] | None = None,
    expert_count: int | None = None,
) -> Path:
    """Write `model_dir` as a GGUF file. qtype: one of QTYPES or MIXES; arch: the GGUF architecture name to
    claim (default: the model's); override: GGUF tensor name -> array written instead (any dtype the writer
    accepts); expert_count: the metadata's expert count instead of the model's (an MoE model's experts are
    written as llama.cpp's 3-D ffn_*_exps tensors, its router in F32 as llama.cpp keeps it)."""
    cfg = AutoConfig.from_pretrained(model_dir)
    real_arch = GGUF_ARCH.get(cfg.model_type, cfg.model_type)
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
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts if expert_count is None else expert_count)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
        w.add_expert_weights_norm(cfg.model_type == "mixtral" or cfg.norm_topk_prob)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _tokenizer_metadata(w, model_dir)

    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == real_arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for hf_name, t in _stack_experts(load_file(str(model_dir / "model.safetensors"))).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        t = t.astype(np.float32)
        if real_arch == "gemma3" and hf_name.endswith("norm.weight"):
            t = t + np.float32(1)  # llama.cpp stores Gemma's RMSNorm scale 1 + w
        if real_arch == "llama" and ".q_proj." in hf_name:  # Mixtral's too: a "llama" file
            t = llamacpp_permute(t, heads)
        elif real_arch == "llama" and ".k_proj." in hf_name:
            t = llamacpp_permute(t, kv_heads)
        qt = mixed_type(qtype, name) if qtype in MIXES else qtype
        if override and name in override:
            w.add_tensor(name, override[name])
        elif t.ndim == 1 or qt == "F32" or "ffn_gate_inp" in name:
            w.add_tensor(name, t)
        elif qt == "F16":
            w.add_tensor(name, t.astype(np.float16))
        elif qt in K_QUANTS:
            blocks = [
                k_quant_blocks(qt, *m.shape, seed=len(name) + t.size + e)
                for e, m in enumerate(t.reshape(-1, *t.shape[-2:]))
            ]
            w.add_tensor(name, np.stack(blocks).reshape(*t.shape[:-1], -1), raw_dtype=QTYPES[qt])
        else:
            w.add_tensor(name, gguf.quants.quantize(t, QTYPES[qt]), raw_dtype=QTYPES[qt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

"""Every model architecture the engine runs, one entry each: its Hugging Face name, the class that runs it,
the module names its checkpoints and GGUF files hold, and the facts every process reads about it (sliding
layers, how llama.cpp wrote its GGUF files). A new model is its model file (worker/models/), one entry here
and its `make-model` preset (launch/model_presets.py); docs/architecture.md has the recipe.

No torch, gguf or transformers import: the frontend and the scheduler read this too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.protocol.errors import ModelLoadError
from tandem.protocol.gemma3_vision import gemma3_text_config, gemma3_vision_config
from tandem.protocol.gguf_gemma3 import gemma3_gguf_config
from tandem.protocol.qwen2_5_vision import qwen2_5_vl_text_config, qwen2_5_vl_vision_config

# A decoder layer's module names, by part (gguf's tensor-name map turns each into its GGUF name).
NORMS = ("input_layernorm", "post_attention_layernorm")
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
QK_NORM = ("self_attn.q_norm", "self_attn.k_norm")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# the router and the [E, rows, inputs] expert stacks (a layer off the MoE grid has MLP's instead)
EXPERTS = ("mlp.gate", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
SHARED_EXPERT = (
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
)
SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")  # Gemma's four norms a layer
GLOBAL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json's architectures[0]
    # "module:Class": a module of tandem.worker.models or a dotted path (worker/models/registry.py imports it)
    model_class: str
    model_type: str  # transformers' model_type, written into the config.json of a GGUF file
    layer_modules: tuple[str, ...]  # a decoder layer's module names (NORMS + ATTENTION + ...)
    # Layers may attend a sliding window (config layer_types / sliding_window_pattern): the engine runs them.
    sliding_layers: bool = False
    # A prompt's images attend among their own tokens both ways (Gemma 3), not causally: a prefill chunk may
    # not end inside an image, and the attention gives an image's tokens the whole image.
    images_bidirectional: bool = False
    # ---- its GGUF files, as llama.cpp's converter writes them -------------------------------------------
    gguf_arch: str | None = None  # general.architecture (None: no GGUF file is read as this architecture)
    gguf_moe: bool = False  # a file of gguf_arch with expert tensors is this architecture (Mixtral's "llama")
    # MoE fields as Mixtral's config spells them: num_local_experts, experts intermediate_size wide
    mixtral_experts: bool = False
    gguf_norm_topk: bool = False  # renormalise the top-k routing weights when the file does not say
    gguf_qk_permuted: bool = False  # the converter interleaved each head's Q/K rows (undone on load)
    gguf_norm_offset: float = 0.0  # norm weights stored as w + offset (Gemma's RMSNorm scales by 1 + w)
    # config field -> the tensor whose presence sets it (a llama file's biases)
    gguf_tensor_flags: dict[str, str] = field(default_factory=dict)
    # what the metadata adds to config.json beyond the common fields: (meta(key), config, path) -> fields
    gguf_config: Callable[[Callable[..., Any], dict[str, Any], Any], dict[str, Any]] | None = None
    # ---- a vision-language model's config.json, which nests its text model's (None: a text model's) --------
    # the text model's fields, flat, from the whole config (ModelConfig reads them)
    text_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # the image encoder's and the image placeholders' fields (ModelConfig.vision, a VisionConfig)
    vision_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            "LlamaForCausalLM",
            "llama:LlamaForCausalLM",
            "llama",
            NORMS + ATTENTION + MLP,
            gguf_arch="llama",
            gguf_qk_permuted=True,
            gguf_tensor_flags={"attention_bias": "blk.0.attn_q.bias", "mlp_bias": "blk.0.ffn_gate.bias"},
        ),
        Architecture(
            "Qwen2ForCausalLM", "llama:Qwen2ForCausalLM", "qwen2", NORMS + ATTENTION + MLP, gguf_arch="qwen2"
        ),
        Architecture(
            "Qwen3ForCausalLM",
            "llama:Qwen3ForCausalLM",
            "qwen3",
            NORMS + ATTENTION + QK_NORM + MLP,
            gguf_arch="qwen3",
        ),
        Architecture(
            "Qwen2MoeForCausalLM",
            "moe:Qwen2MoeForCausalLM",
            "qwen2_moe",
            NORMS + ATTENTION + MLP + EXPERTS + SHARED_EXPERT,
            gguf_arch="qwen2moe",
            gguf_moe=True,
            gguf_tensor_flags={"qkv_bias": "blk.0.attn_q.bias"},
        ),
        Architecture(
            "Qwen3MoeForCausalLM",
            "moe:Qwen3MoeForCausalLM",
            "qwen3_moe",
            NORMS + ATTENTION + QK_NORM + MLP + EXPERTS,
            gguf_arch="qwen3moe",
            gguf_moe=True,
            gguf_norm_topk=True,
        ),
        Architecture(
            "MixtralForCausalLM",
            "moe:MixtralForCausalLM",
            "mixtral",
            NORMS + ATTENTION + EXPERTS,
            gguf_arch="llama",
            gguf_moe=True,
            mixtral_experts=True,
            gguf_norm_topk=True,
            gguf_qk_permuted=True,
        ),
        Architecture(
            "Gemma3ForCausalLM",
            "gemma3:Gemma3ForCausalLM",
            "gemma3_text",
            NORMS + SANDWICH_NORMS + ATTENTION + QK_NORM + MLP,
            sliding_layers=True,
            gguf_arch="gemma3",
            gguf_norm_offset=1.0,
            gguf_config=gemma3_gguf_config,
        ),
        Architecture(  # Gemma 3 with SigLIP images (4B, 12B, 27B): the text model above, no GGUF file yet
            "Gemma3ForConditionalGeneration",
            "gemma3_mm:Gemma3ForConditionalGeneration",
            "gemma3",
            NORMS + SANDWICH_NORMS + ATTENTION + QK_NORM + MLP,
            sliding_layers=True,
            images_bidirectional=True,
            text_config=gemma3_text_config,
            vision_config=gemma3_vision_config,
        ),
        Architecture(  # Qwen2.5-VL: Qwen2's text model (multimodal RoPE), a dynamic-resolution ViT; no GGUF
            "Qwen2_5_VLForConditionalGeneration",
            "qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
            "qwen2_5_vl",
            NORMS + ATTENTION + MLP,
            text_config=qwen2_5_vl_text_config,
            vision_config=qwen2_5_vl_vision_config,
        ),
    )
}
SLIDING_ARCHS = tuple(a.name for a in ARCHITECTURES.values() if a.sliding_layers)
GGUF_ARCHS = tuple(sorted({a.gguf_arch for a in ARCHITECTURES.values() if a.gguf_arch}))


def architecture(name: str | None) -> Architecture:
    """The entry of a config's architecture; a ModelLoadError naming the supported ones otherwise."""
    try:
        return ARCHITECTURES[name]  # type: ignore[index]
    except KeyError:
        raise ModelLoadError(
            f"unsupported model architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def gguf_architecture(gguf_arch: Any, path: Any, moe: bool | None = None) -> Architecture:
    """The architecture a GGUF file of `general.architecture` gguf_arch runs as; `moe`: whether it has
    expert tensors (None: any, the first entry)."""
    found = [a for a in ARCHITECTURES.values() if a.gguf_arch == gguf_arch]
    if not found:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(GGUF_ARCHS)}"
        )
    if moe is not None and len(found) > 1:
        found = [a for a in found if a.gguf_moe == moe] or found
    return found[0]

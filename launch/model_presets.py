"""`tandem make-model`'s presets: the sizes (hidden width, layers, heads, ...) and the architectures it
writes, each with the transformers config class that describes it (launch/make_model.py builds and fills
them)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import (
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)


@dataclass(frozen=True)
class SizeSpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    # The MoE archs: each expert's width; 8 experts, top 2 (the defaults of make_model), so a token's active
    # MLP (2 x moe_intermediate) is the dense `intermediate` of the same size.
    moe_intermediate: int = 0


SIZES: dict[str, SizeSpec] = {
    "tiny": SizeSpec(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=1024,
        max_positions=2048,
        moe_intermediate=64,
    ),
    "small": SizeSpec(
        hidden=256,
        layers=4,
        heads=8,
        kv_heads=4,
        head_dim=32,
        intermediate=768,
        vocab=4096,
        max_positions=4096,
        moe_intermediate=256,
    ),
    # ~29-34M parameters depending on tying: big enough to be GPU-bound in benchmarks, quick to write.
    "bench": SizeSpec(
        hidden=512,
        layers=8,
        heads=8,
        kv_heads=4,
        head_dim=64,
        intermediate=1536,
        vocab=8192,
        max_positions=4096,
        moe_intermediate=768,
    ),
    # Llama-3.2-1B's shapes with SmolLM2's vocabulary size (1.07 B parameters tied): the size at which
    # the CPU benchmarks meet llama.cpp on memory bandwidth, not per-step overhead (benchmarks/llama_files).
    "1b": SizeSpec(
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        head_dim=64,
        intermediate=8192,
        vocab=49152,
        max_positions=8192,
        moe_intermediate=4096,
    ),
    # Qwen3-0.6B's shapes (random weights): the GPU throughput benchmark's model.
    "0.6b": SizeSpec(
        hidden=1024,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        intermediate=3072,
        vocab=151936,
        max_positions=40960,
        moe_intermediate=1536,
    ),
}


@dataclass(frozen=True)
class ArchSpec:
    config_cls: type[PretrainedConfig]
    architecture: str
    rope_theta: float
    tie_embeddings: bool
    moe: bool = False
    vision: bool = False  # a vision-language model (launch/vision_model_maker.py writes it)


# Tied and untied archs, so the engine's weight loader sees both layouts. Qwen2's q/k/v bias, Qwen3's
# q_norm/k_norm and Gemma 3's layout come from the architectures themselves.
ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(LlamaConfig, "LlamaForCausalLM", rope_theta=10_000.0, tie_embeddings=False),
    "qwen2": ArchSpec(Qwen2Config, "Qwen2ForCausalLM", rope_theta=1_000_000.0, tie_embeddings=False),
    "qwen3": ArchSpec(Qwen3Config, "Qwen3ForCausalLM", rope_theta=1_000_000.0, tie_embeddings=True),
    # Mixture of experts: Qwen3-MoE (renormalised top-k, as Qwen3-30B-A3B), Qwen2-MoE (a shared expert, top-k
    # not renormalised), Mixtral. Untied like their published checkpoints (make_model's tie_embeddings).
    "qwen3_moe": ArchSpec(Qwen3MoeConfig, "Qwen3MoeForCausalLM", rope_theta=1_000_000.0, tie_embeddings=False,
                          moe=True),
    "qwen2_moe": ArchSpec(Qwen2MoeConfig, "Qwen2MoeForCausalLM", rope_theta=1_000_000.0, tie_embeddings=False,
                          moe=True),
    "mixtral": ArchSpec(MixtralConfig, "MixtralForCausalLM", rope_theta=1_000_000.0, tie_embeddings=False,
                        moe=True),
    "gemma3": ArchSpec(Gemma3TextConfig, "Gemma3ForCausalLM", rope_theta=1_000_000.0, tie_embeddings=True),
    # Gemma 3 with images: the gemma3 text model of the size, a SigLIP encoder (GEMMA3_VISION_SIZES), and an
    # image processor and image tokens with its tokenizer
    "gemma3_vision": ArchSpec(Gemma3Config, "Gemma3ForConditionalGeneration", rope_theta=1_000_000.0,
                              tie_embeddings=True, vision=True),
    # Qwen2.5-VL: the qwen2 text model of the size with multimodal RoPE, a dynamic-resolution encoder
    # (QWEN2_5_VL_VISION_SIZES), its processor and image tokens (launch/qwen_vl_model_maker.py); untied as
    # the 7B
    "qwen2_5_vl": ArchSpec(Qwen2_5_VLConfig, "Qwen2_5_VLForConditionalGeneration", rope_theta=1_000_000.0,
                           tie_embeddings=False, vision=True),
}


@dataclass(frozen=True)
class Gemma3Spec:
    """What a Gemma 3 model of a size has beside SizeSpec: sliding-window layers (every `pattern`-th layer
    global), one KV head, a head wider than hidden / heads, and in `tiny` options a loader that ignored them
    would get wrong: soft-capped logits, linear RoPE scaling on the global layers, a pattern other than 6.
    (The attention scale stays head_dim's, query_pre_attn_scalar = head_dim, which a GGUF file cannot say
    otherwise: tests/test_model_parity.py tries another.) Windows are small, so test prompts run far past."""

    layers: int
    window: int
    pattern: int
    head_dim: int
    query_pre_attn_scalar: int
    final_logit_softcapping: float | None = None
    rope_factor: float | None = None


GEMMA3_SIZES = {
    "tiny": Gemma3Spec(layers=3, window=16, pattern=3, head_dim=32, query_pre_attn_scalar=32,
                       final_logit_softcapping=10.0, rope_factor=2.0),
    "small": Gemma3Spec(layers=6, window=32, pattern=6, head_dim=64, query_pre_attn_scalar=64),
    "bench": Gemma3Spec(layers=12, window=128, pattern=6, head_dim=128, query_pre_attn_scalar=128),
    "1b": Gemma3Spec(layers=16, window=512, pattern=6, head_dim=128, query_pre_attn_scalar=128),
    "0.6b": Gemma3Spec(layers=28, window=512, pattern=6, head_dim=256, query_pre_attn_scalar=256),
}
NUM_EXPERTS, EXPERTS_PER_TOK = 8, 2


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's image encoder (SigLIP) of a size: square images of image_size pixels cut
    into patch_size patches, pooled into mm_tokens_per_image embeddings (a square number whose side divides
    the patches a side)."""

    image_size: int
    patch_size: int
    mm_tokens_per_image: int
    hidden: int
    layers: int
    heads: int
    intermediate: int


GEMMA3_VISION_SIZES = {
    # 4 x 4 patches pooled 2 x 2: an image is 4 tokens
    "tiny": VisionSpec(image_size=28, patch_size=7, mm_tokens_per_image=4, hidden=32, layers=2, heads=2,
                       intermediate=64),
    "small": VisionSpec(image_size=56, patch_size=7, mm_tokens_per_image=16, hidden=64, layers=2, heads=4,
                        intermediate=128),
    "bench": VisionSpec(image_size=224, patch_size=14, mm_tokens_per_image=64, hidden=256, layers=4, heads=4,
                        intermediate=1024),
    # Gemma 3's own encoder (SigLIP so400m: 896 pixels, 64 x 64 patches pooled 4 x 4 into 256 tokens)
    "1b": VisionSpec(image_size=896, patch_size=14, mm_tokens_per_image=256, hidden=1152, layers=27, heads=16,
                     intermediate=4304),
    "0.6b": VisionSpec(image_size=896, patch_size=14, mm_tokens_per_image=256, hidden=1152, layers=27,
                       heads=16, intermediate=4304),
}


@dataclass(frozen=True)
class DynamicVisionSpec:
    """A dynamic-resolution image encoder (Qwen2.5-VL's) of a size: an image resized to whole blocks of
    merge x merge patches of patch_size pixels, between min_pixels and max_pixels, each block one token;
    most blocks attend windows of window_size pixels a side, the `fullatt` ones the whole image."""

    patch_size: int
    window_size: int
    hidden: int
    depth: int
    heads: int
    intermediate: int
    fullatt: tuple[int, ...]
    min_pixels: int
    max_pixels: int
    merge: int = 2
    temporal_patch: int = 2


QWEN2_5_VL_VISION_SIZES = {
    # 7-pixel patches, 2 x 2 blocks of them a window: a 40 x 30 image is 42 x 28 pixels, 6 x 4 patches, 3 x 2
    # tokens in two windows (one cut short); 4 to 32 tokens an image
    "tiny": DynamicVisionSpec(patch_size=7, window_size=28, hidden=32, depth=3, heads=2, intermediate=64,
                              fullatt=(1,), min_pixels=4 * 14 * 14, max_pixels=32 * 14 * 14),
    "small": DynamicVisionSpec(patch_size=14, window_size=56, hidden=64, depth=4, heads=4, intermediate=128,
                               fullatt=(1, 3), min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28),
    "bench": DynamicVisionSpec(patch_size=14, window_size=112, hidden=256, depth=8, heads=4, intermediate=512,
                               fullatt=(3, 7), min_pixels=4 * 28 * 28, max_pixels=256 * 28 * 28),
    # Qwen2.5-VL's own encoder and processor (the 7B's: 1280 wide, 32 blocks, 112-pixel windows)
    "1b": DynamicVisionSpec(patch_size=14, window_size=112, hidden=1280, depth=32, heads=16,
                            intermediate=3420, fullatt=(7, 15, 23, 31), min_pixels=56 * 56,
                            max_pixels=28 * 28 * 1280),
    "0.6b": DynamicVisionSpec(patch_size=14, window_size=112, hidden=1280, depth=32, heads=16,
                              intermediate=3420, fullatt=(7, 15, 23, 31), min_pixels=56 * 56,
                              max_pixels=28 * 28 * 1280),
}

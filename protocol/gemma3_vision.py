"""What a Gemma 3 vision-language config.json holds (HF `Gemma3ForConditionalGeneration`, model_type `gemma3`;
protocol/architectures.py's entry points here): the text model's config nested as `text_config`, the SigLIP
image encoder's as `vision_config`, the image placeholders at the top. Published configs leave out what
equals transformers' defaults (Gemma3TextConfig's, SiglipVisionConfig's, Gemma3Config's: google/gemma-3-4b-it
gives five text fields): they are filled in here as transformers fills them."""

from __future__ import annotations

from typing import Any

from tandem.protocol.errors import ModelLoadError

# transformers 5's Gemma3TextConfig defaults (the 1B text model's), in the spellings ModelConfig reads
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attention_bias": False,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
# SiglipVisionConfig's
SIGLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}
# Gemma3Config's (the placeholder token ids of Gemma 3's tokenizer)
GEMMA3_IMAGE_DEFAULTS: dict[str, Any] = {
    "mm_tokens_per_image": 256,
    "image_token_index": 262_144,
    "boi_token_index": 255_999,
    "eoi_token_index": 256_000,
}
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")  # the encoder MLP's (worker/models/siglip.py runs both)


def gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: text_config over the defaults; the top level's architectures, and its
    tie_word_embeddings (transformers ties by it, True unless it says) and bos/eos where it gives them."""
    text = {**GEMMA3_TEXT_DEFAULTS, **(hf.get("text_config") or {})}
    text.update({k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None})
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    text["architectures"] = hf.get("architectures")
    return text


def gemma3_vision_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The image encoder's and the placeholders' fields (model_config.VisionConfig's), checked: square
    images of whole patches, a square number of tokens an image that pools whole blocks of patches, no
    pooling head (Gemma 3 reads every patch). Anything else is a ModelLoadError naming the field."""
    v = {**SIGLIP_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    top = {**GEMMA3_IMAGE_DEFAULTS, **{k: hf[k] for k in GEMMA3_IMAGE_DEFAULTS if hf.get(k) is not None}}
    if hf.get("image_token_id") is not None:  # transformers' other spelling
        top["image_token_index"] = hf["image_token_id"]
    if v["vision_use_head"]:
        raise ModelLoadError("config field vision_config.vision_use_head: the attention-pooling head is not "
                             "supported (Gemma 3 reads every patch)")
    if v["hidden_act"] not in ACTIVATIONS:
        raise ModelLoadError(f"config field vision_config.hidden_act: {v['hidden_act']!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
    size, patch = _side(v, "image_size"), _side(v, "patch_size")
    if size % patch:
        raise ModelLoadError(f"config field vision_config.image_size: {size} is not a multiple of the "
                             f"patch_size {patch}")
    tokens = top["mm_tokens_per_image"]
    side = int(round(tokens**0.5)) if isinstance(tokens, int) and tokens > 0 else 0
    if side * side != tokens or (size // patch) % side:
        raise ModelLoadError(f"config field mm_tokens_per_image: {tokens!r} is not the square of a divisor "
                             f"of the {size // patch} patches a side")
    if v["hidden_size"] % v["num_attention_heads"]:
        raise ModelLoadError(f"config field vision_config.hidden_size: {v['hidden_size']} is not divisible "
                             f"by num_attention_heads {v['num_attention_heads']}")
    return {
        "hidden_size": int(v["hidden_size"]),
        "intermediate_size": int(v["intermediate_size"]),
        "num_hidden_layers": int(v["num_hidden_layers"]),
        "num_attention_heads": int(v["num_attention_heads"]),
        "num_channels": int(v["num_channels"]),
        "image_size": size,
        "patch_size": patch,
        "hidden_act": str(v["hidden_act"]),
        "layer_norm_eps": float(v["layer_norm_eps"]),
        "mm_tokens_per_image": tokens,
        "image_token_id": int(top["image_token_index"]),
        "boi_token_id": int(top["boi_token_index"]),
        "eoi_token_id": int(top["eoi_token_index"]),
    }


def _side(v: dict[str, Any], key: str) -> int:
    """A square's side: SigLIP's sizes are an int or an equal [height, width] pair."""
    x = v[key]
    if isinstance(x, (list, tuple)) and len(x) == 2 and x[0] == x[1]:
        x = x[0]
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ModelLoadError(f"config field vision_config.{key}: {x!r} is not a square's side in pixels")
    return x

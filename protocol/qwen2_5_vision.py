"""What a Qwen2.5-VL config.json holds (HF `Qwen2_5_VLForConditionalGeneration`, model_type `qwen2_5_vl`;
protocol/architectures.py's entry points here). The published checkpoints' configs are flat: the text model's
fields at the top level beside `vision_config` (Qwen/Qwen2.5-VL-7B-Instruct's); transformers 5's
save_pretrained nests them as `text_config`. Both read the same here, the nested one first. The text model's
RoPE is multimodal (`rope_scaling` {"type": "mrope", "mrope_section": [16, 24, 24]}): plain RoPE of the
same theta over three position rows, `mrope_section` of the head's frequencies each (worker/models/mrope.py);
the section goes to VisionConfig.mrope_section, the text model reads plain RoPE. What a config leaves out is
transformers' default (Qwen2_5_VLTextConfig's, Qwen2_5_VLVisionConfig's, Qwen2_5_VLConfig's)."""

from __future__ import annotations

from typing import Any

from tandem.protocol.errors import ModelLoadError

# transformers 5's Qwen2_5_VLTextConfig defaults, in the spellings ModelConfig reads
QWEN2_5_VL_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152_064,
    "hidden_size": 8192,
    "intermediate_size": 29_568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "bos_token_id": 151_643,
    "eos_token_id": 151_645,
}
# Qwen2_5_VLVisionConfig's (what the published configs say too, but in_chans for in_channels)
QWEN2_5_VL_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
# Qwen2_5_VLConfig's: the image placeholder and the tokens around an image
QWEN2_5_VL_IMAGE_DEFAULTS: dict[str, Any] = {
    "image_token_id": 151_655,
    "vision_start_token_id": 151_652,
    "vision_end_token_id": 151_653,
}
MROPE_SECTION_DEFAULT = [16, 24, 24]  # transformers' when the config gives none
VISION_ROPE_THETA = 10_000.0  # the encoder's 2D RoPE (transformers' axial default)
VISION_NORM_EPS = 1e-6  # the encoder's RMSNorms (fixed in transformers)
# the keys of a flat config that are not the text model's
NOT_TEXT = ("text_config", "vision_config", "architectures", "model_type", *QWEN2_5_VL_IMAGE_DEFAULTS,
            "video_token_id", "vision_token_id")


def qwen2_5_vl_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config, flat, as ModelConfig reads a Qwen2's: text_config over the top level's text
    fields over the defaults, its RoPE plain (the mrope_section taken out), the top level's architectures
    and tie_word_embeddings (transformers ties by the top level's, or text_config's where that says so)."""
    top = {k: v for k, v in hf.items() if k not in NOT_TEXT}
    text = {**QWEN2_5_VL_TEXT_DEFAULTS, **top, **(hf.get("text_config") or {})}
    params = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    text.pop("rope_scaling", None)
    params.pop("mrope_section", None)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params["rope_type"] = "default" if kind == "mrope" else kind  # mrope is plain RoPE on 3 position rows
    params.setdefault("rope_theta", text.get("rope_theta") or QWEN2_5_VL_TEXT_DEFAULTS["rope_theta"])
    text["rope_parameters"] = params
    inner = hf.get("text_config") or {}
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings") or inner.get("tie_word_embeddings"))
    text.pop("head_dim", None)  # Qwen2.5-VL's attention is hidden / heads wide whatever a config says
    text["architectures"] = hf.get("architectures")
    return text


def qwen2_5_vl_vision_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The encoder's and the placeholders' fields (model_config.VisionConfig's), checked: heads that split
    the width into a multiple of 4 (the 2D RoPE's halves of halves), SiLU blocks, windows of whole merged
    tokens, an mrope_section that covers half the text model's head. Anything else is a ModelLoadError naming
    the field. image_size and mm_tokens_per_image are 0: an image's size, and so its tokens, vary."""
    v = {**QWEN2_5_VL_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if "in_chans" in v and "in_channels" not in (hf.get("vision_config") or {}):  # the published spelling
        v["in_channels"] = v["in_chans"]
    given = {k: hf[k] for k in QWEN2_5_VL_IMAGE_DEFAULTS if hf.get(k) is not None}
    top = {**QWEN2_5_VL_IMAGE_DEFAULTS, **given}
    hidden, heads = _count(v, "hidden_size"), _count(v, "num_heads")
    if hidden % heads or (hidden // heads) % 4:
        raise ModelLoadError(f"config field vision_config.num_heads: {heads} heads of {hidden} do not make a "
                             "head width that is a multiple of 4 (the 2D RoPE's)")
    if v["hidden_act"] != "silu":
        raise ModelLoadError(f"config field vision_config.hidden_act: {v['hidden_act']!r} is not supported "
                             "(silu)")
    depth, patch, merge = _count(v, "depth"), _count(v, "patch_size"), _count(v, "spatial_merge_size")
    full = v.get("fullatt_block_indexes") or []
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth for i in full):
        raise ModelLoadError(f"config field vision_config.fullatt_block_indexes: {full!r} are not block "
                             f"indexes below the depth {depth}")
    window = v.get("window_size")
    if len(set(full)) < depth and (not isinstance(window, int) or window < patch * merge):
        raise ModelLoadError(f"config field vision_config.window_size: {window!r} is not a window of at "
                             f"least one merged token ({patch * merge} pixels)")
    text = qwen2_5_vl_text_config(hf)
    section = _mrope_section(hf)
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    if sum(section) != half:
        raise ModelLoadError(f"config field rope_scaling.mrope_section: {section!r} does not add up to half "
                             f"the text model's head ({half})")
    return {
        "hidden_size": hidden,
        "intermediate_size": _count(v, "intermediate_size"),
        "num_hidden_layers": depth,
        "num_attention_heads": heads,
        "num_channels": _count(v, "in_channels"),
        "image_size": 0,
        "patch_size": patch,
        "hidden_act": "silu",
        "layer_norm_eps": VISION_NORM_EPS,
        "mm_tokens_per_image": 0,
        "image_token_id": int(top["image_token_id"]),
        "boi_token_id": int(top["vision_start_token_id"]),
        "eoi_token_id": int(top["vision_end_token_id"]),
        "out_hidden_size": _count(v, "out_hidden_size"),
        "spatial_merge_size": merge,
        "temporal_patch_size": _count(v, "temporal_patch_size"),
        "window_size": int(window or 0),
        "fullatt_block_indexes": tuple(sorted(set(full))),
        "rope_theta": float((v.get("rope_parameters") or {}).get("rope_theta") or VISION_ROPE_THETA),
        "mrope_section": tuple(section),
    }


def _mrope_section(hf: dict[str, Any]) -> list[int]:
    """The text RoPE's mrope_section, wherever the config keeps it (transformers' default otherwise)."""
    for where in (hf.get("text_config") or {}, hf):
        for key in ("rope_parameters", "rope_scaling"):
            section = (where.get(key) or {}).get("mrope_section")
            if section is not None:
                if not isinstance(section, list) or len(section) != 3 or any(
                        isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in section):
                    raise ModelLoadError(f"config field {key}.mrope_section: {section!r} is not three counts")
                return section
    return list(MROPE_SECTION_DEFAULT)


def _count(v: dict[str, Any], key: str) -> int:
    x = v[key]
    if isinstance(x, (list, tuple)) and len(x) == 2 and x[0] == x[1]:  # a square patch given as a pair
        x = x[0]
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ModelLoadError(f"config field vision_config.{key}: {x!r} is not a count >= 1")
    return x

"""`tandem make-model --arch qwen2_5_vl`: a seeded random Qwen2.5-VL directory (HF
`Qwen2_5_VLForConditionalGeneration`) that transformers loads offline, with its processor.

    tandem make-model --arch qwen2_5_vl --size tiny --out models/tiny-qwen2_5_vl

- config.json: Qwen2_5_VLConfig of make_model's qwen2 text model of the size (text_config, its RoPE
  multimodal: mrope_section a quarter, three eighths and three eighths of half the head, as Qwen's
  [16, 24, 24]) and an encoder of model_presets.QWEN2_5_VL_VISION_SIZES (vision_config), the image token ids
  the tokenizer's;
- model.safetensors, under the published checkpoints' names (what transformers 5's save_pretrained writes
  too): the text model as make_model seeds Qwen2's (`model.*`, `lm_head.*`), the encoder seeded here
  (`visual.*`), an image token's embedding about as large as a text token's;
- the tokenizer of every made model with Qwen's image tokens added (<|vision_start|>, <|vision_end|>,
  <|image_pad|>, <|video_pad|>), its chat template taking image parts (`{"type": "image"}` ->
  "<|vision_start|><|image_pad|><|vision_end|>"), and processor_config.json: a Qwen2_5_VLProcessor whose
  image processor resizes an image to whole merged tokens between the size's min and max pixels (CLIP's mean
  and std, as Qwen's) and which expands each <|image_pad|> into the image's t*h*w / 4 of them. It is written
  as transformers writes it, video processor included: transformers builds a Qwen2_5_VLProcessor only where
  torchvision is installed (its video processor needs it), so AutoProcessor loads it there; the image
  processor alone (AutoImageProcessor) and the tokenizer load anywhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save
from transformers import PretrainedConfig, Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tandem.launch.make_model import (
    BIAS_STD,
    EMBED_SCALE,
    LINEAR_GAIN,
    NORM_JITTER,
    build_config,
    init_weights,
)
from tandem.launch.model_presets import ARCHS, QWEN2_5_VL_VISION_SIZES, SIZES, DynamicVisionSpec
from tandem.launch.tokenizer_maker import EOS_TOKEN, IM_END
from tandem.launch.vision_model_maker import (
    VISION_SEED,
    VOCAB_ALIGN,
    image_chat_template,
    save_config,
    write_image_tokenizer,
)

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"  # Qwen's names
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
# the names Qwen2_5_VLProcessor reads the tokens by (tokenizer.image_token, .video_token)
NAMED_TOKENS = {"vision_bos_token": VISION_START, "vision_eos_token": VISION_END, "image_token": IMAGE_PAD,
                "video_token": VIDEO_PAD}
QWEN_VL_CHAT_TEMPLATE = image_chat_template(VISION_START + IMAGE_PAD + VISION_END)
GELU_RMS = 0.65  # the RMS of GELU(x) for x ~ N(0, 1): what the merger's last layer reads


def make_qwen2_5_vl_model(arch: str, size: str, out: Path, seed: int = 0, num_kv_heads: int | None = None,
                          tie_embeddings: bool | None = None) -> Path:
    """Write config, weights, tokenizer, processor and generation config into `out` (make_model's
    make_model calls it for the qwen2_5_vl arch)."""
    spec, vs = ARCHS[arch], QWEN2_5_VL_VISION_SIZES[size]
    tie = spec.tie_embeddings if tie_embeddings is None else tie_embeddings
    out.mkdir(parents=True, exist_ok=True)
    ids = write_image_tokenizer(out, SIZES[size].vocab, SIZES[size].max_positions, NAMED_TOKENS,
                                QWEN_VL_CHAT_TEMPLATE)
    vocab = -(-(max(ids.values()) + 1) // VOCAB_ALIGN) * VOCAB_ALIGN
    eos = ids[EOS_TOKEN]
    text = build_config("qwen2", size, vocab, eos, num_kv_heads, tie_embeddings=tie)
    config = Qwen2_5_VLConfig(
        architectures=[spec.architecture],
        text_config=qwen_vl_text_config(text),
        vision_config=qwen_vl_vision_config(vs, text.hidden_size),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=tie,
        dtype="float32",
    )
    save_config(config, out)
    weights = init_weights(text, seed)  # Qwen2's names: the published checkpoints' model.* and lm_head.*
    weights.update(init_encoder_weights(config, seed + VISION_SEED))
    (out / "model.safetensors").write_bytes(save(weights, metadata={"format": "pt"}))
    gen_config = {"eos_token_id": [eos, ids[IM_END]], "pad_token_id": eos, "do_sample": False}  # make_model's
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n", encoding="utf-8")
    _write_processor(out, vs)
    return out


def mrope_section(head_dim: int) -> list[int]:
    """Qwen's split of half the head over (frame, row, column): [16, 24, 24] of 64, scaled."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def qwen_vl_text_config(text: PretrainedConfig) -> dict[str, object]:
    """make_model's Qwen2 config as Qwen2_5_VLTextConfig's fields."""
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "eos_token_id",
              "pad_token_id")
    head_dim = text.hidden_size // text.num_attention_heads
    rope = {"rope_type": "default", "rope_theta": ARCHS["qwen2_5_vl"].rope_theta,
            "mrope_section": mrope_section(head_dim)}
    return {**{k: getattr(text, k) for k in fields}, "bos_token_id": None,
            "tie_word_embeddings": text.tie_word_embeddings, "rope_parameters": rope}


def qwen_vl_vision_config(vs: DynamicVisionSpec, text_hidden: int) -> dict[str, object]:
    return {
        "depth": vs.depth, "hidden_size": vs.hidden, "intermediate_size": vs.intermediate,
        "num_heads": vs.heads, "hidden_act": "silu", "in_channels": 3, "patch_size": vs.patch_size,
        "spatial_merge_size": vs.merge, "temporal_patch_size": vs.temporal_patch,
        "window_size": vs.window_size, "out_hidden_size": text_hidden,
        "fullatt_block_indexes": list(vs.fullatt),
    }


def init_encoder_weights(config: Qwen2_5_VLConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights of the encoder, in sorted-name order, under the published names (`visual.*`)."""
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel(config.vision_config)
    shapes = {f"visual.{k}": t.shape for k, t in tower.state_dict().items()}
    token_std = EMBED_SCALE / config.text_config.hidden_size**0.5  # make_model's token embeddings' std
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        mean, std = _encoder_std(name, shapes[name], token_std)
        weights[name] = torch.randn(shapes[name], generator=gen, dtype=torch.float32) * std + mean
    return weights


def _encoder_std(name: str, shape: torch.Size, token_std: float) -> tuple[float, float]:
    """(mean, std) of one encoder parameter, by its role."""
    if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):  # RMSNorm: scales by w
        return 1.0, NORM_JITTER
    if name == "visual.merger.mlp.2.weight":  # the image tokens: about a text token's embedding
        return 0.0, token_std / (GELU_RMS * shape[1] ** 0.5)
    if name == "visual.merger.mlp.2.bias":
        return 0.0, token_std
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    return 0.0, LINEAR_GAIN / math.prod(shape[1:]) ** 0.5  # linear layers and the patch conv: by fan-in


def _write_processor(out: Path, vs: DynamicVisionSpec) -> None:
    """processor_config.json as transformers writes a Qwen2_5_VLProcessor's (which it cannot build without
    torchvision), and the chat template beside it."""
    images = Qwen2VLImageProcessorPil(min_pixels=vs.min_pixels, max_pixels=vs.max_pixels,
                                      patch_size=vs.patch_size, temporal_patch_size=vs.temporal_patch,
                                      merge_size=vs.merge)
    image = json.loads(images.to_json_string())
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video.update(video_processor_type="Qwen2VLVideoProcessor", do_sample_frames=False)
    processor = {"image_processor": image, "processor_class": "Qwen2_5_VLProcessor", "video_processor": video}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n",
                                               encoding="utf-8")
    (out / "chat_template.jinja").write_text(QWEN_VL_CHAT_TEMPLATE, encoding="utf-8")

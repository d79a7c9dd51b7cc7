"""`tandem make-model --arch gemma3_vision`: a seeded random Gemma 3 vision-language directory (HF
`Gemma3ForConditionalGeneration`) that transformers loads offline, with its processor.

    tandem make-model --arch gemma3_vision --size tiny --out models/tiny-gemma3-vision

- config.json: Gemma3Config of make_model's gemma3 text model of the size (text_config) and a SigLIP encoder
  of model_presets.GEMMA3_VISION_SIZES (vision_config), the image token ids the tokenizer's;
- model.safetensors, under the published checkpoints' names: the text model as make_model seeds Gemma 3's
  (`language_model.model.*`), the encoder and the projector seeded here (`vision_tower.vision_model.*`,
  `multi_modal_projector.*`), an image's embeddings as large as a token's;
- the tokenizer of every made model with Gemma's three image tokens added, its chat template taking image
  parts (`{"type": "image"}` -> `<start_of_image>`), and processor_config.json: a Gemma3Processor whose
  image processor resizes to the encoder's image_size (mean and std 0.5, as Gemma's) and which writes one
  image as "\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n".
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save
from tokenizers import AddedToken
from transformers import AutoTokenizer, Gemma3Config, Gemma3Processor, SiglipVisionConfig, SiglipVisionModel

from tandem.launch.make_model import (
    BIAS_STD,
    EMBED_SCALE,
    LINEAR_GAIN,
    NORM_JITTER,
    build_config,
    init_weights,
)
from tandem.launch.model_presets import ARCHS, GEMMA3_VISION_SIZES, SIZES, VisionSpec
from tandem.launch.tokenizer_maker import (
    EOS_TOKEN,
    IM_END,
    special_token_ids,
    tokenizer_config,
    train_tokenizer,
)

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"  # Gemma 3's names
IMAGE_MEAN = IMAGE_STD = [0.5, 0.5, 0.5]  # pixels to [-1, 1]
POSITION_STD = 0.5  # the encoder's position embeddings: as large as a random image's patch embeddings
VOCAB_ALIGN = 64  # the embedding padded past the tokenizer (its three image tokens) to a multiple of this
VISION_SEED = 1 << 20  # the encoder's weights are drawn with seed + this (the text model's with seed)


def image_chat_template(image: str) -> str:
    """make_model's template, a message's content also a list of parts: text, or an image's placeholder
    `image` (the processor expands it into the image's tokens)."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] in ('image', 'image_url') %}" + image
        + "{% elif p['type'] == 'text' %}{{ p['text'] }}"
        "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


VISION_CHAT_TEMPLATE = image_chat_template(BOI)


def make_vision_model(arch: str, size: str, out: Path, seed: int = 0, num_kv_heads: int | None = None,
                      tie_embeddings: bool | None = None) -> Path:
    """Write config, weights, tokenizer, processor and generation config into `out` (make_model's
    make_model calls it for an arch of ARCHS with `vision`)."""
    spec, vs = ARCHS[arch], GEMMA3_VISION_SIZES[size]
    tie = spec.tie_embeddings if tie_embeddings is None else tie_embeddings
    out.mkdir(parents=True, exist_ok=True)
    # the names Gemma3Processor reads the image tokens by (tokenizer.boi_token, .image_token, ...)
    named = {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}
    ids = write_image_tokenizer(out, SIZES[size].vocab, SIZES[size].max_positions, named,
                                VISION_CHAT_TEMPLATE)
    vocab = -(-(max(ids.values()) + 1) // VOCAB_ALIGN) * VOCAB_ALIGN
    text = build_config("gemma3", size, vocab, ids[EOS_TOKEN], num_kv_heads, tie_embeddings=tie)
    text.architectures = None  # the top level names the model
    config = Gemma3Config(
        architectures=[spec.architecture],
        text_config=text,
        vision_config=vision_config(vs),
        mm_tokens_per_image=vs.mm_tokens_per_image,
        boi_token_index=ids[BOI],
        image_token_index=ids[IMAGE],
        eoi_token_index=ids[EOI],
        tie_word_embeddings=tie,
        dtype="float32",
    )
    save_config(config, out)
    weights = {_published_name(k): v for k, v in init_weights(text, seed).items()}
    weights.update(init_vision_weights(config, seed + VISION_SEED))
    (out / "model.safetensors").write_bytes(save(weights, metadata={"format": "pt"}))
    eos = ids[EOS_TOKEN]
    gen_config = {"eos_token_id": [eos, ids[IM_END]], "pad_token_id": eos, "do_sample": False}  # make_model's
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n", encoding="utf-8")
    _write_processor(out, vs)
    return out


def vision_config(vs: VisionSpec) -> SiglipVisionConfig:
    return SiglipVisionConfig(
        hidden_size=vs.hidden, intermediate_size=vs.intermediate, num_hidden_layers=vs.layers,
        num_attention_heads=vs.heads, image_size=vs.image_size, patch_size=vs.patch_size,
        hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False,
    )


def _published_name(name: str) -> str:
    """make_model's Gemma 3 text names -> a Gemma 3 vision checkpoint's."""
    return "language_model." + name


def init_vision_weights(config: Gemma3Config, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights of the encoder and the projector, in sorted-name order, under the published names."""
    with torch.device("meta"):
        tower = SiglipVisionModel(config.vision_config)
    vh, th = config.vision_config.hidden_size, config.text_config.hidden_size
    shapes = {f"vision_tower.vision_model.{k}": t.shape for k, t in tower.state_dict().items()}
    shapes["multi_modal_projector.mm_input_projection_weight"] = torch.Size([vh, th])
    shapes["multi_modal_projector.mm_soft_emb_norm.weight"] = torch.Size([vh])
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        mean, std = _vision_std(name, shapes[name])
        weights[name] = torch.randn(shapes[name], generator=gen, dtype=torch.float32) * std + mean
    return weights


def _vision_std(name: str, shape: torch.Size) -> tuple[float, float]:
    """(mean, std) of one encoder or projector parameter, by its role."""
    if name.endswith("mm_soft_emb_norm.weight"):  # Gemma's RMSNorm: scales by 1 + w
        return 0.0, NORM_JITTER
    if "layernorm" in name.replace("_", "") and name.endswith(".weight"):  # LayerNorm: scales by w
        return 1.0, NORM_JITTER
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    if name.endswith("position_embedding.weight"):
        return 0.0, POSITION_STD
    if name.endswith("mm_input_projection_weight"):  # x [.., vision] @ W: its rows are the inputs
        # normed patches (RMS 1) -> embeddings of std EMBED_SCALE, a scaled token embedding's (make_model)
        return 0.0, EMBED_SCALE / shape[0] ** 0.5
    return 0.0, LINEAR_GAIN / math.prod(shape[1:]) ** 0.5  # linear layers and the patch conv: by fan-in


def save_config(config: object, out: Path) -> None:
    """config.json as transformers writes it, with torch_dtype beside dtype (as make_model's: both
    spellings)."""
    config.save_pretrained(out)  # type: ignore[attr-defined]
    raw = json.loads((out / "config.json").read_text(encoding="utf-8"))
    raw.setdefault("torch_dtype", "float32")
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_image_tokenizer(out: Path, vocab_size: int, model_max_length: int, named: dict[str, str],
                          chat_template: str) -> dict[str, int]:
    """make_model's tokenizer with the image tokens added (named: the attribute the processor reads each
    by -> the token; special: never split from text, left out of decoded replies); their ids and EOS's /
    IM_END's. The processor writes the tokenizer's files again."""
    tok = train_tokenizer(vocab_size)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named.values()])
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    tok_config = tokenizer_config(model_max_length, chat_template, extra_special_tokens=named)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    ids = {t: tok.token_to_id(t) for t in named.values()}
    return {**special_token_ids(tok), **ids}


def _write_processor(out: Path, vs: VisionSpec) -> None:
    # the PIL-backed processor: transformers writes the same config for its torchvision twin
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = Gemma3ImageProcessorPil(
        size={"height": vs.image_size, "width": vs.image_size}, image_mean=IMAGE_MEAN, image_std=IMAGE_STD,
        do_pan_and_scan=False,
    )
    processor = Gemma3Processor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(out),
                                chat_template=VISION_CHAT_TEMPLATE, image_seq_length=vs.mm_tokens_per_image)
    processor.save_pretrained(out)

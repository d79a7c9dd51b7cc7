"""A model's hyper-parameters, read by every process and the benchmarks from one place: the config.json of
a Hugging Face directory, or the one derived from a GGUF file's metadata (see protocol/gguf_metadata.py).
No transformers or torch import."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.protocol.architectures import ARCHITECTURES, SLIDING_ARCHS
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.gguf_metadata import gguf_metadata_dir, is_gguf

DEFAULT_MAX_POSITIONS = 2048  # what transformers assumes for a Llama config without max_position_embeddings
# RoPE variants worker/layers/rotary.py computes; any other is refused while the config is read.
ROPE_TYPES = ("default", "linear", "llama3")
FULL, SLIDING = "full_attention", "sliding_attention"


def metadata_dir(model: str | Path) -> Path:
    """The directory holding config.json, generation_config.json and the tokenizer files: the model
    directory itself, or a GGUF file's cached metadata."""
    if is_gguf(model):
        return gguf_metadata_dir(model)
    d = Path(model)
    if not (d / "config.json").is_file():
        raise ModelLoadError(
            f"{d} is not a model: no config.json (expected a Hugging Face directory or a .gguf file)"
        )
    return d


def read_hf_config(model: str | Path) -> dict[str, Any]:
    return json.loads((metadata_dir(model) / "config.json").read_text(encoding="utf-8"))


def read_model_config(model: str | Path, **arch_flags: Any) -> ModelConfig:
    return ModelConfig.from_hf(read_hf_config(model), **arch_flags)


# patches of an image one piece of an encoder layer takes at most (VisionConfig.row_blocks): about a tenth
# of a second at SigLIP-400M's width on two CPU cores
ENCODER_ROWS_PER_PIECE = 512


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's image encoder and how an image enters the prompt: as placeholder tokens
    (image_token_id), between boi and eoi tokens, whose embeddings the encoder's output replaces. Gemma 3's
    (a SigLIP ViT): square images of image_size pixels, mm_tokens_per_image tokens each. Qwen2.5-VL's
    (dynamic resolution, `dynamic`): image_size and mm_tokens_per_image 0, an image of any size (the
    processor's multiple of patch_size * spatial_merge_size) cut into a [t, h, w] grid of patches, merged
    spatial_merge_size^2 into a token: t * h * w / spatial_merge_size^2 tokens an image."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int  # the encoder takes square images of image_size pixels a side
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    mm_tokens_per_image: int  # embeddings an image becomes (patches pooled to a square of them)
    image_token_id: int
    boi_token_id: int | None = None  # Qwen2.5-VL's vision_start_token_id
    eoi_token_id: int | None = None  # Qwen2.5-VL's vision_end_token_id
    # ---- dynamic resolution (Qwen2.5-VL; the defaults are Gemma 3's none) ---------------------------------
    out_hidden_size: int = 0  # the merger's output width: the text model's hidden size
    spatial_merge_size: int = 1  # patches merged into a token, a side
    temporal_patch_size: int = 1  # frames a patch spans (an image's one frame repeated)
    window_size: int = 0  # pixels a side of the windows most blocks attend within
    fullatt_block_indexes: tuple[int, ...] = ()  # the blocks that attend the whole image
    rope_theta: float = 10_000.0  # the encoder's 2D RoPE
    mrope_section: tuple[int, ...] = ()  # the text RoPE's frequencies per position row (t, h, w)

    @property
    def dynamic(self) -> bool:
        """An image's size, and so its token count, varies (its grid says both)."""
        return self.image_size == 0

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.mm_tokens_per_image**0.5))

    @property
    def row_blocks(self) -> int:
        """Blocks of patches a layer of a fixed-size image's encoding is run in, a piece each after one for
        every patch's K and V (worker/models/siglip.py), so no piece of a large encoder is long; a
        dynamic-resolution model's layers run whole."""
        return 1 if self.dynamic else -(-self.patches_per_side**2 // ENCODER_ROWS_PER_PIECE)

    @property
    def pieces_per_layer(self) -> int:
        return 1 if self.row_blocks == 1 else self.row_blocks + 1

    @property
    def encoder_pieces(self) -> int:
        """The pieces an image's encoding is: what the scheduler spreads over steps."""
        return self.num_hidden_layers * self.pieces_per_layer


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    # rope_parameters minus rope_theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; {} = plain RoPE.
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # Architecture-specific switches; the model class fills them in (see worker/models/llama.py).
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (0 experts: a dense model). A layer is MoE unless listed in mlp_only_layers or off
    # the decoder_sparse_step grid, as transformers' Qwen2/3-MoE decide; Mixtral's are all MoE.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Per layer, FULL or SLIDING (empty: every layer full); a SLIDING layer attends its last
    # `sliding_window` keys (its own included), with RoPE from local_rope_theta / local_rope_scaling.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    local_rope_theta: float = 0.0
    local_rope_scaling: dict[str, Any] = field(default_factory=dict)
    query_pre_attn_scalar: float | None = None  # attention scale = its -1/2 power (None: head_dim's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    vision: VisionConfig | None = None  # a vision-language model's image encoder (None: text only)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **arch_flags: Any) -> ModelConfig:
        entry = ARCHITECTURES.get((hf.get("architectures") or [""])[0])
        vision = None
        if entry is not None and entry.vision_config is not None:
            vision = VisionConfig(**entry.vision_config(hf))
        if entry is not None and entry.text_config is not None:  # the rest is the nested text model's
            hf = entry.text_config(hf)
        archs = hf.get("architectures") or []
        num_heads = hf["num_attention_heads"]
        # Some configs carry "head_dim": null; fall back to hidden / heads then.
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        arch = archs[0] if archs else ""
        windows = _sliding_layers(hf, arch)
        if hf.get("attn_logit_softcapping") is not None:
            raise ModelLoadError(
                "config field attn_logit_softcapping: attention score softcapping is not supported"
            )
        rope_theta, rope_scaling = _rope_params(hf, FULL)
        local_theta, local_scaling = _rope_params(hf, SLIDING) if SLIDING in windows else (0.0, {})
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            hidden_act=hf.get("hidden_act") or hf.get("hidden_activation") or "silu",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            layer_types=windows,
            sliding_window=int(hf["sliding_window"]) if SLIDING in windows else 0,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            vision=vision,
            **{**_moe_params(hf), **arch_flags},
        )

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING in self.layer_types

    def is_moe_layer(self, layer_id: int) -> bool:
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width a token's product reads in an MoE layer (its top-k experts and the shared one), or
        the dense MLP's."""
        if not self.num_experts:
            return self.intermediate_size
        return self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size

    def local_kv_heads(self, tp_size: int) -> int:
        """KV heads one tensor-parallel rank holds (and caches): a share, or 1 replicated head when fewer
        KV heads than ranks."""
        return max(1, self.num_key_value_heads // tp_size)


def _rope_params(hf: dict[str, Any], layer_type: str = FULL) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of one kind of layer. transformers 5 saves ``rope_parameters`` (theta inside; per
    layer type for Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}); older configs use
    ``rope_theta`` + ``rope_scaling`` (Gemma 3: ``rope_local_base_freq`` for the sliding layers, whose RoPE
    the scaling does not touch). Accept both; an unknown rope_type is a ModelLoadError naming the field."""
    params = hf.get("rope_parameters") or {}
    where = "rope_parameters"
    if isinstance(params, dict) and {FULL, SLIDING} & set(params):  # per layer type
        params, where = params.get(layer_type) or {}, f"rope_parameters.{layer_type}"
    elif layer_type == SLIDING:  # one set for both kinds: the global one's theta is not the local one's
        params, where = {}, "rope_local_base_freq"
    if not params and layer_type == FULL:
        params, where = hf.get("rope_scaling") or {}, "rope_scaling"
    params = dict(params)
    theta = params.pop("rope_theta", None) or (
        hf.get("rope_local_base_freq", 10000.0) if layer_type == SLIDING else hf.get("rope_theta") or 10000.0
    )
    # Old configs spell the type "type"; "default" means no scaling.
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"config field {where}.rope_type: {rope_type!r} is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), {}
    return float(theta), {"rope_type": rope_type, **params}


def _sliding_layers(hf: dict[str, Any], arch: str) -> tuple[str, ...]:
    """The config's layer_types (FULL / SLIDING per layer), checked: Gemma 3 derives them, when absent, from
    ``sliding_window_pattern`` (every pattern-th layer full; 6 by default) as transformers does. Anything
    malformed is a ModelLoadError naming the field."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    gemma3 = arch in SLIDING_ARCHS
    if types is None and gemma3:
        pattern = hf.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelLoadError(
                f"config field sliding_window_pattern: {pattern!r} is not a layer count >= 1"
            )
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if types is None:
        if hf.get("use_sliding_window"):
            raise ModelLoadError("config field use_sliding_window: sliding-window layers are supported for "
                                 f"{', '.join(SLIDING_ARCHS)} only")
        return ()
    if not isinstance(types, list) or len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        raise ModelLoadError(f"config field layer_types: expected {n} entries of {FULL!r} or {SLIDING!r}, "
                             f"got {types!r}")
    if SLIDING not in types:
        return tuple(types)
    if not gemma3:
        raise ModelLoadError(f"config field layer_types: sliding-window layers are supported for "
                             f"{', '.join(SLIDING_ARCHS)} only")
    window = hf.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"config field sliding_window: {window!r} is not a key count >= 1")
    return tuple(types)


def _moe_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a Qwen2/3-MoE or Mixtral config (Mixtral spells the expert count
    num_local_experts and sizes its experts with intermediate_size: its arch_flags say so)."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if not experts:
        return {}
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(hf["num_experts_per_tok"]),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
    }

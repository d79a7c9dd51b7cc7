"""Gemma 3 with images: HF `Gemma3ForConditionalGeneration` (model_type `gemma3`; the 4B, 12B and 27B
models). The text model is Gemma3ForCausalLM's, unchanged (this class is one: forward, hidden_states, the
logits, the weights' packing are its own); beside it, the SigLIP encoder (worker/models/siglip.py) and the
projector that turns an image into mm_tokens_per_image embeddings of the text model's width
(`encode_images`). Those embeddings take the place of the prompt's image placeholder tokens (image_token_id)
as they are: not scaled by sqrt(hidden) as a token's embedding is.

Checkpoints name the parts three ways (the published one, transformers 4.52+'s and what transformers 5's
save_pretrained writes): `CHECKPOINT_PREFIXES` maps each onto the module names here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.ops import Ops
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.gemma3_vision import gemma3_text_config
from tandem.protocol.model_config import ModelConfig, VisionConfig
from tandem.worker.layers import ColumnParallelLinear, GemmaRMSNorm
from tandem.worker.layers.linear import full_tensor
from tandem.worker.models.encoder_stages import Stages, run_stages
from tandem.worker.models.gemma3 import Gemma3ForCausalLM
from tandem.worker.models.registry import renamed
from tandem.worker.models.siglip import SiglipVisionModel

# a checkpoint's prefix -> this model's (the first that matches; names in this layout pass as they are)
CHECKPOINT_PREFIXES = (
    ("language_model.model.", "model."),  # the published checkpoints'; transformers 5's save_pretrained
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),  # transformers 4.52+'s own names
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),  # transformers 5 (SigLIP without its vision_model level)
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
# the projector's matrix, [vision hidden, text hidden] (x @ W), is loaded transposed into a linear layer
PROJECTION = (
    "multi_modal_projector.mm_input_projection_weight",
    "multi_modal_projector.mm_input_projection.weight",
)


class Gemma3MultiModalProjector(nn.Module):
    """The encoder's patches [n, patches, vision hidden] -> [n, mm_tokens_per_image, text hidden]: averaged
    over square blocks of patches (side / tokens_per_side wide), each RMS-normed (Gemma's, by 1 + w) and
    projected."""

    def __init__(
        self, cfg: VisionConfig, text_hidden: int, dtype: torch.dtype, device: Any, ops: Ops
    ) -> None:
        super().__init__()
        self.mm_soft_emb_norm = GemmaRMSNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device, ops)
        self.mm_input_projection = ColumnParallelLinear(cfg.hidden_size, [text_hidden], False, dtype, device,
                                                        ops=ops)
        self.side = cfg.patches_per_side
        self.kernel = cfg.patches_per_side // cfg.tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, d = patches.shape
        grid = patches.transpose(1, 2).reshape(n, d, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [n, tokens, d]
        tokens = pooled.shape[1]
        x = self.mm_soft_emb_norm(pooled.reshape(n * tokens, d))
        return self.mm_input_projection(x).view(n, tokens, -1)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """`cfg`: the text model's (ModelConfig.from_hf reads the nested text_config), with the image encoder's
    in cfg.vision. The encoder and projector are whole on every rank (tensor parallelism splits the text model
    only), so any rank encodes an image alone, with no collective."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        if cfg.vision is None:
            raise ModelLoadError("Gemma3ForConditionalGeneration: the config has no vision_config")
        super().__init__(cfg, dtype, device, ops, tp_rank, tp_size)
        v = cfg.vision
        self.vision_tower = SiglipVisionModel(v, dtype, device, ops, tp_rank=0, tp_size=1)
        self.multi_modal_projector = Gemma3MultiModalProjector(v, cfg.hidden_size, dtype, device, ops)
        # what the rest of the engine reads (config.json's): a prompt's image is mm_tokens_per_image
        # image_token_id tokens (between boi_token_id and eoi_token_id), its pixels [3, image_size,
        # image_size]
        self.image_token_id, self.mm_tokens_per_image = v.image_token_id, v.mm_tokens_per_image
        self.boi_token_id, self.eoi_token_id = v.boi_token_id, v.eoi_token_id
        self.image_size, self.num_channels = v.image_size, v.num_channels

    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        return Gemma3ForCausalLM.arch_flags(gemma3_text_config(hf))

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, 3, image_size, image_size] (the image processor's output) -> the embeddings that
        replace each image's placeholder tokens, [n, mm_tokens_per_image, hidden] in the model's dtype
        (transformers' get_image_features(...).pooler_output)."""
        return run_stages(self.image_stages(pixel_values))

    def image_stages(self, pixel_values: torch.Tensor) -> Stages:
        """encode_images in pieces, one per encoder layer (models/encoder_stages.py)."""
        patches = yield from self.vision_tower.stages(pixel_values.to(self.device))
        return self.multi_modal_projector(patches)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(_own_names(weights))


def _own_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in renamed(weights, CHECKPOINT_PREFIXES):
        if name == PROJECTION[0]:
            name, tensor = PROJECTION[1], full_tensor(tensor).t()
        yield name, tensor

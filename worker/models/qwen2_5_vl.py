"""Qwen2.5-VL: HF `Qwen2_5_VLForConditionalGeneration` (model_type `qwen2_5_vl`; the 3B, 7B, 32B and 72B
models). The text model is Qwen2ForCausalLM's, unchanged (this class is one: forward, hidden_states, the
logits, the weights' packing are its own); beside it the dynamic-resolution encoder (worker/models/
qwen2_5_vision.py, `visual`) that turns an image of any size into t*h*w / spatial_merge_size^2 embeddings of
the text model's width (`encode_images`), which take the place of the prompt's image placeholder tokens
(image_token_id, between vision_start and vision_end) as they are.

The text model's RoPE is multimodal: each token has three positions (frame, row, column: equal for text;
an image's tokens their grid's), the head's frequencies split into mrope_section parts that rotate by one of
them each (worker/models/mrope.py computes both; the forward here still runs plain RoPE on batch.positions,
which is the same for text).

Checkpoints name the parts two ways (the published one, which transformers 5's save_pretrained writes too,
and transformers 4.52+'s): `CHECKPOINT_PREFIXES` maps the second onto the module names here, the first's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from tandem.kernels.ops import Ops
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_config import ModelConfig
from tandem.protocol.qwen2_5_vision import qwen2_5_vl_text_config
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.models.encoder_stages import Stages, run_stages
from tandem.worker.models.llama import Qwen2ForCausalLM
from tandem.worker.models.mrope import mrope_cos_sin
from tandem.worker.models.qwen2_5_vision import Qwen2_5_VisionTransformer
from tandem.worker.models.registry import renamed

# a checkpoint's prefix -> this model's (the first that matches; names in this layout pass as they are:
# model.*, lm_head.*, visual.*)
CHECKPOINT_PREFIXES = (
    ("model.language_model.", "model."),  # transformers 4.52+'s own names
    ("model.visual.", "visual."),
)


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """`cfg`: the text model's (ModelConfig.from_hf reads the nested or flat text fields), with the image
    encoder's in cfg.vision. The encoder is whole on every rank (tensor parallelism splits the text model
    only), so any rank encodes an image alone, with no collective."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        v = cfg.vision
        if v is None or not v.dynamic:
            raise ModelLoadError("Qwen2_5_VLForConditionalGeneration: the config has no vision_config")
        if v.out_hidden_size != cfg.hidden_size:
            raise ModelLoadError(f"config field vision_config.out_hidden_size: {v.out_hidden_size} is not "
                                 f"the text model's hidden_size {cfg.hidden_size}")
        super().__init__(cfg, dtype, device, ops, tp_rank, tp_size)
        self.visual = Qwen2_5_VisionTransformer(v, dtype, device, ops)
        # what the rest of the engine reads (config.json's): a prompt's image is t*h*w / spatial_merge_size^2
        # image_token_id tokens between vision_start and vision_end, its pixels the processor's rows
        # [t*h*w, num_channels * temporal_patch_size * patch_size^2]; the text RoPE's mrope_section
        self.image_token_id = v.image_token_id
        self.vision_start_token_id, self.vision_end_token_id = v.boi_token_id, v.eoi_token_id
        self.spatial_merge_size, self.mrope_section = v.spatial_merge_size, tuple(v.mrope_section)
        self.patch_size, self.temporal_patch_size = v.patch_size, v.temporal_patch_size
        self.num_channels = v.num_channels

    @property
    def vision_tower(self) -> Qwen2_5_VisionTransformer:
        """The encoder (the checkpoint calls it `visual`)."""
        return self.visual

    @staticmethod
    def arch_flags(hf: dict[str, Any]) -> dict[str, Any]:
        return Qwen2ForCausalLM.arch_flags(qwen2_5_vl_text_config(hf))

    def image_tokens(self, grid: Sequence[int]) -> int:
        """The placeholder tokens of an image of patch grid [t, h, w]."""
        t, h, w = grid
        return t * h * w // self.spatial_merge_size**2

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """ONE image: pixels [t*h*w, C*T*P*P] (the processor's pixel_values rows for it), grid its [t, h, w]
        (image_grid_thw) -> the embeddings that replace its placeholder tokens, [t*h*w / merge^2, hidden] in
        the model's dtype, in the placeholders' order (transformers' get_image_features's pooler_output)."""
        return run_stages(self.image_stages(pixels, grid))

    def image_stages(self, pixels: torch.Tensor, grid: Sequence[int]) -> Stages:
        """encode_images in pieces, one per encoder block (models/encoder_stages.py)."""
        return self.visual.stages(pixels.to(self.device), [grid])

    def rope_tables(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Multimodal RoPE where the step holds a request with images (batch.rope_positions), else plain."""
        if batch.rope_positions is None:
            return super().rope_tables(batch)
        return mrope_cos_sin(self.rotary, batch.rope_positions, self.mrope_section)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(renamed(weights, CHECKPOINT_PREFIXES))

"""llama.cpp's multimodal projector file (Gemma 3's: a SigLIP tower and the projector) read as the
checkpoint names worker/models/gemma3_mm.py loads. Its tensors are small: dequantized to the model's dtype
(the converter keeps the projection matrix in F16); the soft embedding norm's weight comes back to
transformers' w (the converter stored 1 + w, as llama.cpp's RMSNorm multiplies by the weight itself)."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tandem.protocol.errors import ModelLoadError
from tandem.protocol.gguf_metadata import open_gguf

TOWER = "vision_tower.vision_model."
FIXED = {
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
    "v.patch_embd.weight": TOWER + "embeddings.patch_embedding.weight",
    "v.patch_embd.bias": TOWER + "embeddings.patch_embedding.bias",
    "v.position_embd.weight": TOWER + "embeddings.position_embedding.weight",
    "v.post_ln.weight": TOWER + "post_layernorm.weight",
    "v.post_ln.bias": TOWER + "post_layernorm.bias",
}
LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1",
         "ffn_down": "mlp.fc2"}
_BLOCK = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    if name in FIXED:
        return FIXED[name]
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in LAYER:
        return None
    return f"{TOWER}encoder.layers.{m.group(1)}.{LAYER[m.group(2)]}.{m.group(3)}"


def iter_mmproj_weights(path: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    for t in open_gguf(path).tensors:
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} in a Gemma 3 projector file")
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name == "mm.soft_emb_norm.weight":
            w = w - np.float32(1)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)

"""SigLIP's vision encoder: HF `SiglipVisionModel` as Gemma 3 runs it (no attention-pooling head: every
patch's embedding comes out).

A ViT: the image cut into patch_size x patch_size patches (the checkpoint's conv, kernel = stride = the
patch, run as a linear layer over each patch's pixels), a learned position embedding per patch, pre-norm
encoder layers (LayerNorm with bias; bidirectional multi-head attention, q/k/v/out with bias; an MLP of
GELU, tanh form), a final LayerNorm. Its linear layers are the decoder's (the `Ops`' product, q/k/v fused as
the Llama's: `STACKED` maps the checkpoint's names); the attention is torch's SDPA over each image's
patches, no mask. Module names follow the checkpoint's (`embeddings.patch_embedding`, `encoder.layers.N.
self_attn.q_proj`, `post_layernorm`, ...).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.ops import Ops
from tandem.protocol.model_config import VisionConfig
from tandem.worker.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tandem.worker.layers.linear import full_tensor
from tandem.worker.models.encoder_stages import Stages, run_stages

# config hidden_act -> F.gelu's `approximate` (protocol/gemma3_vision.py refuses the rest)
GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class SiglipLayerNorm(nn.Module):
    """LayerNorm with weight and bias (replicated on every rank), in the model's dtype as torch's."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        getattr(self, param).data.copy_(full_tensor(tensor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class SiglipPatchEmbedding(ColumnParallelLinear):
    """The patch conv as a linear layer: [hidden, C, p, p] flattened to [hidden, C*p*p], each patch's pixels
    in the same (channel, row, column) order; patches row by row, as the conv's output is flattened."""

    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        p = cfg.patch_size
        super().__init__(cfg.num_channels * p * p, [cfg.hidden_size], True, dtype, device, tp_rank, tp_size,
                         ops)
        self.patch, self.grid, self.channels = p, cfg.patches_per_side, cfg.num_channels

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        t = full_tensor(tensor)
        super().load_weight(t.reshape(t.shape[0], -1) if param == "weight" else t, shard, param)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, C, H, W] -> [n * patches, hidden]."""
        n, g, p = pixels.shape[0], self.grid, self.patch
        patches = pixels.reshape(n, self.channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        return self.product(patches.reshape(n * g * g, -1), self.bias)


class SiglipPositionEmbedding(nn.Module):
    """One learned vector per patch position (HF's nn.Embedding over 0..patches-1)."""

    def __init__(self, num_positions: int, hidden: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_positions, hidden, dtype=dtype, device=device),
                                   requires_grad=False)

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        self.weight.data.copy_(full_tensor(tensor))


class SiglipVisionEmbeddings(nn.Module):
    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.patch_embedding = SiglipPatchEmbedding(cfg, dtype, device, ops, tp_rank, tp_size)
        self.position_embedding = SiglipPositionEmbedding(cfg.patches_per_side**2, cfg.hidden_size, dtype,
                                                          device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[n, C, H, W] -> [n, patches, hidden]."""
        h = self.patch_embedding(pixels).view(pixels.shape[0], -1, self.position_embedding.weight.shape[1])
        return h.add_(self.position_embedding.weight)


class SiglipAttention(nn.Module):
    """Every patch of an image attends every patch of it (softmax(q k^T / sqrt(d)) v), per head."""

    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        self.head_dim = d = cfg.hidden_size // heads
        tp = {"dtype": dtype, "device": device, "tp_rank": tp_rank, "tp_size": tp_size, "ops": ops}
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, heads, heads, True, **tp)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(heads * d, cfg.hidden_size, True, **tp)
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [n * patches, hidden] of n images."""
        return self.attend(*self.qkv(x, n))

    def qkv(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
        """q, k, v [n, heads, patches, head_dim] of x [n * patches, hidden]."""
        return self.qkv_proj(x).view(n, -1, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Some patches' queries [n, heads, p, head_dim] over all of k, v -> their outputs [n * p, hidden]."""
        o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(o.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim))


class SiglipMLP(nn.Module):
    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        tp = {"dtype": dtype, "device": device, "tp_rank": tp_rank, "tp_size": tp_size, "ops": ops}
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], True, **tp)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, **tp)
        self.approximate = GELU_APPROXIMATE[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.layer_norm1 = SiglipLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device)
        self.self_attn = SiglipAttention(cfg, dtype, device, ops, tp_rank, tp_size)
        self.layer_norm2 = SiglipLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device)
        self.mlp = SiglipMLP(cfg, dtype, device, ops, tp_rank, tp_size)

    def forward(self, h: torch.Tensor, n: int) -> torch.Tensor:
        return run_stages(self.stages(h, n, 1))

    def stages(self, h: torch.Tensor, n: int, blocks: int) -> Stages:
        """The layer over h [n * patches, hidden] in pieces: every patch's q, k, v, then the attention and MLP
        of `blocks` blocks of patches, a piece each (one piece in all when blocks is 1). The same sums: a
        patch's output depends on the other patches only through their k and v."""
        attn = self.self_attn
        q, k, v = attn.qkv(self.layer_norm1(h), n)
        if blocks == 1:
            h = h + attn.attend(q, k, v)
            return h + self.mlp(self.layer_norm2(h))
        patches, width = q.shape[2], h.shape[-1]
        rows, out = h.view(n, patches, width), torch.empty_like(h).view(n, patches, width)
        bounds = [patches * i // blocks for i in range(blocks + 1)]
        for a, b in zip(bounds, bounds[1:]):
            yield
            x = rows[:, a:b].reshape(-1, width) + attn.attend(q[:, :, a:b], k, v)
            out[:, a:b] = (x + self.mlp(self.layer_norm2(x))).view(n, b - a, width)
        return out.view(n * patches, width)


class SiglipEncoder(nn.Module):
    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            SiglipEncoderLayer(cfg, dtype, device, ops, tp_rank, tp_size)
            for _ in range(cfg.num_hidden_layers)
        )


class SiglipVisionModel(nn.Module):
    """pixels [n, C, image_size, image_size] -> the last layer's normed patch embeddings [n, patches,
    hidden]. tp_size > 1 splits the heads and the MLP over ranks (an all-reduce after out_proj and fc2, as the
    decoder's); Gemma 3 builds it whole on every rank (tp_size 1), so a rank encodes alone."""

    def __init__(
        self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.config, self.dtype = cfg, dtype
        # the patches are not split over ranks: every rank embeds all of them
        self.embeddings = SiglipVisionEmbeddings(cfg, dtype, device, ops, 0, 1)
        self.encoder = SiglipEncoder(cfg, dtype, device, ops, tp_rank, tp_size)
        self.post_layernorm = SiglipLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return run_stages(self.stages(pixels))

    def stages(self, pixels: torch.Tensor) -> Stages:
        """The encoding in pieces (models/encoder_stages.py): cfg.pieces_per_layer a layer."""
        cfg = self.config
        want = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != want:
            raise ValueError(f"pixel_values of shape {tuple(pixels.shape)}: the encoder takes [n, {want[0]}, "
                             f"{want[1]}, {want[2]}]")
        n = pixels.shape[0]
        h = self.embeddings(pixels.to(self.dtype))
        h = h.view(n * h.shape[1], -1)  # the layers' products take rows
        for i, layer in enumerate(self.encoder.layers):
            if i:
                yield
            h = yield from layer.stages(h, n, cfg.row_blocks)
        return self.post_layernorm(h).view(n, -1, cfg.hidden_size)

"""Qwen2.5-VL's vision encoder: HF `Qwen2_5_VisionTransformerPretrainedModel`, dynamic resolution.

An image arrives as the processor's rows: its [t, h, w] grid of patches (t frames of temporal_patch_size,
an image's one frame repeated), each row one patch's C * T * P * P pixels, the rows in merge-block order
(each spatial_merge_size x spatial_merge_size block of patches consecutive, the blocks row by row). Then:
the patch conv (kernel = stride = the patch: a linear layer over each row), a 2D RoPE over each patch's
(row, column) in the grid, `depth` pre-norm blocks (RMSNorm; attention with q/k/v fused and biased; a SwiGLU
MLP with biases) that attend within windows of window_size pixels a side, but for the fullatt_block_indexes
blocks, which attend each frame whole; at the end the patch merger (RMSNorm, then each block of
spatial_merge_size^2 patches concatenated through Linear-GELU-Linear) into one token of the text model's
width per block.

As transformers, the rows are put in window order once (whole merge blocks move, so the merger's groups stay
together), every block attends runs of consecutive rows (a window, or a frame), and the merger's tokens are
put back in the processor's order. The attention is torch's SDPA on each run, runs of one length in one
batched call, no mask. Module names follow the checkpoint's (`patch_embed.proj`, `blocks.N.attn.qkv`,
`merger.mlp.0`, ...); gate_proj and up_proj load into one fused layer (llama.py's STACKED).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.ops import Ops
from tandem.protocol.model_config import VisionConfig
from tandem.worker.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from tandem.worker.layers.linear import full_tensor
from tandem.worker.models.encoder_stages import Stages, run_stages

Grid = Sequence[int]  # [t, h, w]: frames, patch rows, patch columns


class Qwen2_5_VisionPatchProj(ColumnParallelLinear):
    """The patch conv, [hidden, C, T, P, P] flattened to [hidden, C*T*P*P]: the processor's rows hold each
    patch's pixels in that (channel, frame, row, column) order, so the conv is this product, no bias."""

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        t = full_tensor(tensor)
        super().load_weight(t.reshape(t.shape[0], -1), shard, param)


class Qwen2_5_VisionAttention(nn.Module):
    """Each run of rows (a window or a frame) attends itself, both ways, after the 2D RoPE on q and k."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.ops, self.num_heads = ops, cfg.num_attention_heads
        self.head_dim = h // self.num_heads
        self.qkv = ColumnParallelLinear(h, [3 * h], True, dtype, device, ops=ops)  # rows [q | k | v]
        self.proj = RowParallelLinear(h, h, True, dtype, device, ops=ops)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                runs: list[tuple[torch.Tensor | None, int]]) -> torch.Tensor:
        n, heads, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv(x).view(n, 3 * heads, d)
        # q and k rotated together, in float32 as transformers (then back to the model's dtype)
        qk = self.ops.rotary(qkv[:, : 2 * heads].float(), cos, sin).to(x.dtype)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, 2 * heads :]
        return self.proj(attend_runs(q, k, v, runs, self.scale).view(n, heads * d))


def attend_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                runs: list[tuple[torch.Tensor | None, int]], scale: float) -> torch.Tensor:
    """q, k, v [N, heads, d] -> [N, heads, d]: each run attends only itself. runs: (row indices [n, L] of the
    n runs of length L, or None where the rows are n runs of L in order, end to end)."""
    n, heads, d = q.shape
    out = None if runs[0][0] is None else q.new_empty(n, heads, d)
    for idx, length in runs:
        if idx is None:
            w = n // length
            parts = [t.reshape(w, length, heads, d).transpose(1, 2) for t in (q, k, v)]
            return F.scaled_dot_product_attention(*parts, scale=scale).transpose(1, 2).reshape(n, heads, d)
        flat = idx.reshape(-1)
        parts = [t[flat].view(idx.shape[0], length, heads, d).transpose(1, 2) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*parts, scale=scale)
        out[flat] = o.transpose(1, 2).reshape(-1, heads, d)  # type: ignore[index]
    return out  # type: ignore[return-value]


class Qwen2_5_VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.ops = ops
        self.gate_up_proj = ColumnParallelLinear(h, [inter, inter], True, dtype, device, ops=ops)
        self.down_proj = RowParallelLinear(inter, h, True, dtype, device, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class Qwen2_5_VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device, ops)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device, ops)
        self.attn = Qwen2_5_VisionAttention(cfg, dtype, device, ops)
        self.mlp = Qwen2_5_VisionMLP(cfg, dtype, device, ops)

    def forward(self, h: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        # h is the encoder's own activation: the residual adds go in place
        x = self.norm2.add_forward(h, self.attn(self.norm1(h), *attn_args))
        return h.add_(self.mlp(x))


class Qwen2_5_VisionPatchMerger(nn.Module):
    """Each block of merge^2 patches (consecutive rows) RMS-normed, concatenated, Linear-GELU-Linear'd into
    one token of the text model's width."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype, device, ops)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.width, [self.width], True, dtype, device, ops=ops),
            nn.GELU(),
            ColumnParallelLinear(self.width, [cfg.out_hidden_size], True, dtype, device, ops=ops),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2_5_VisionTransformer(nn.Module):
    """The processor's rows of some images [sum of t*h*w, C*T*P*P] and their grids -> their tokens
    [sum of t*h*w / merge^2, out_hidden_size], image after image, each in the processor's order (the
    placeholders'). Whole on every rank (no tensor parallelism): a rank encodes alone."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        super().__init__()
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.merge = cfg.spatial_merge_size
        # patches of a window a side, in merged tokens (transformers' vit_merger_window_size)
        self.window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        self.row_width = cfg.num_channels * cfg.temporal_patch_size * cfg.patch_size**2
        self.patch_embed = nn.ModuleDict({"proj": Qwen2_5_VisionPatchProj(
            self.row_width, [cfg.hidden_size], False, dtype, device, ops=ops)})
        self.blocks = nn.ModuleList(Qwen2_5_VisionBlock(cfg, dtype, device, ops)
                                    for _ in range(cfg.num_hidden_layers))
        self.merger = Qwen2_5_VisionPatchMerger(cfg, dtype, device, ops)
        spatial = cfg.hidden_size // cfg.num_attention_heads // 2  # per axis: a quarter of the head
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        return run_stages(self.stages(pixels, grids))

    def stages(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> Stages:
        """The encoding in pieces, a block each (models/encoder_stages.py)."""
        grids = [tuple(int(x) for x in g) for g in grids]
        self._check(pixels, grids)
        device = self.device
        unit = self.merge**2
        order, window_cu = vision_windows(grids, self.merge, self.window)
        frame_cu = [0]
        for t, h, w in grids:
            frame_cu += [frame_cu[-1] + h * w * (f + 1) for f in range(t)]
        runs = {"window": _runs(window_cu, device), "full": _runs(frame_cu, device)}
        order = order.to(device)

        def windowed(x: torch.Tensor) -> torch.Tensor:  # whole merge blocks into window order
            return x.view(-1, unit, x.shape[-1])[order].view(-1, x.shape[-1])

        h = windowed(self.patch_embed["proj"](pixels.to(device, self.dtype)))
        positions = vision_patch_positions(grids, self.merge).to(device).float()
        # [N, head_dim / 2]: the row's frequencies, then the column's
        half = windowed((positions[..., None] * self.inv_freq.to(device)).flatten(1))
        cos = torch.cat((half.cos(), half.cos()), -1).unsqueeze(1)
        sin = torch.cat((-half.sin(), half.sin()), -1).unsqueeze(1)  # the ops' table: rotate_half's sign
        full = set(self.config.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            if i:
                yield
            h = block(h, cos, sin, runs["full" if i in full else "window"])
        return self.merger(h)[torch.argsort(order)]

    def _check(self, pixels: torch.Tensor, grids: list[tuple[int, ...]]) -> None:
        rows = 0
        for g in grids:
            if len(g) != 3 or min(g) < 1 or g[1] % self.merge or g[2] % self.merge:
                raise ValueError(f"image grid {list(g)}: not [t, h, w] with h and w multiples of "
                                 f"{self.merge}")
            rows += g[0] * g[1] * g[2]
        if pixels.dim() != 2 or tuple(pixels.shape) != (rows, self.row_width):
            raise ValueError(f"pixel rows of shape {tuple(pixels.shape)}: grids {[list(g) for g in grids]} "
                             f"take [{rows}, {self.row_width}]")


def vision_patch_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """[N, 2] int64: each row's patch (row, column) in its frame, the rows in the processor's order (merge
    blocks row by row, each block's patches row by row), frame after frame, image after image."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        pos = torch.stack([rows, cols], -1).reshape(h // merge, merge, w // merge, merge, 2)
        out.append(pos.permute(0, 2, 1, 3, 4).reshape(h * w, 2).repeat(t, 1))
    return torch.cat(out)


def vision_windows(grids: Sequence[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The window order of the merge blocks (transformers' get_vision_window_index): each frame cut into
    windows of `window` blocks a side from its top left (the last row and column of windows cut short), the
    windows row by row, each window's blocks row by row. Returns (the blocks' indices in that order, the
    windows' boundaries in rows, cumulative from 0)."""
    order, cu, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        if window < 1:  # no window attention anywhere: one window a frame
            order.append(torch.arange(t * gh * gw) + base)
            cu += [cu[-1] + gh * gw * merge * merge] * t
            base += t * gh * gw
            continue
        nh, nw = -(-gh // window), -(-gw // window)
        idx = F.pad(torch.arange(gh * gw).view(gh, gw), (0, nw * window - gw, 0, nh * window - gh), value=-1)
        idx = idx.view(nh, window, nw, window).permute(0, 2, 1, 3).reshape(nh * nw, window * window)
        kept = idx >= 0
        sizes = kept.sum(1).tolist()
        flat = idx[kept]
        for f in range(t):
            order.append(flat + base + f * gh * gw)
            for s in sizes:
                cu.append(cu[-1] + s * merge * merge)
        base += t * gh * gw
    return torch.cat(order), cu


def _runs(cu: list[int], device: Any) -> list[tuple[torch.Tensor | None, int]]:
    """attend_runs' runs from boundaries: the runs of each length together."""
    by_length: dict[int, list[int]] = {}
    for a, b in zip(cu, cu[1:], strict=False):
        if b > a:
            by_length.setdefault(b - a, []).append(a)
    if len(by_length) == 1:
        ((length, starts),) = by_length.items()
        if starts == list(range(0, cu[-1], length)):
            return [(None, length)]
    return [((torch.tensor(starts).view(-1, 1) + torch.arange(length)).to(device), length)
            for length, starts in by_length.items()]

"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): every token has three positions, (frame, row, column), and the
head's rotary frequencies are split into mrope_section parts (the first section's frequencies rotate by the
frame position, the next by the row, the last by the column; both halves of the rotate_half layout alike).

A text token's three positions are equal, one more than the previous token's largest, so a text-only
prompt's are plain RoPE's (0, 1, 2, ...). An image's tokens (t frames of h x w merged tokens) sit at
(start + frame, start + row, start + column), start being where the text before it left off; the text after
it goes on from start + max(h, w) (the image counts its larger side, not its tokens). So positions run
behind token indices: `next_position_delta` (transformers' rope_deltas) is what to add to a token's index
past the prompt (decode) to get its position, the same in all three rows.

Pure functions of the prompt and the grids: the engine computes a request's [3, L] positions once, slices
each step's rows out of them, and gets a step's cos/sin tables from them with mrope_cos_sin (the ops'
rotary then rotates q and k by those tables as by plain RoPE's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.kernels.ops import Ops
from tandem.worker.layers import RotaryEmbedding


def mrope_positions(
    input_ids: Sequence[int], image_grids: Sequence[Sequence[int]], image_token_id: int,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """A prompt's positions [3, L] int64 (rows: frame, row, column) and its next_position_delta: the
    position of token index p >= L is p + delta in every row. Each image is its grid's (patch grid [t, h, w])
    t*h*w / merge^2 consecutive image_token_id tokens, the images in order. Equal to transformers'
    Qwen2_5_VLModel.get_rope_index for images (no video). A ValueError where the prompt's image tokens and
    the grids disagree."""
    ids = torch.as_tensor(list(input_ids), dtype=torch.int64)
    n_ids, m = ids.shape[0], spatial_merge_size
    is_image = ids == image_token_id
    out = torch.empty(3, n_ids, dtype=torch.int64)
    at = pos = 0  # the next token, the next text position
    for k, grid in enumerate(image_grids):
        t, h, w = (int(x) for x in grid)
        if h % m or w % m:
            raise ValueError(f"image {k}: grid {list(grid)} is not whole {m} x {m} blocks")
        found = torch.nonzero(is_image[at:])
        if not len(found):
            raise ValueError(f"image {k}: the prompt has no image tokens left for it")
        start = at + int(found[0])
        out[:, at:start] = torch.arange(pos, pos + start - at)  # the text before it
        pos += start - at
        lh, lw = h // m, w // m
        n = t * lh * lw
        if start + n > n_ids or not bool(is_image[start : start + n].all()):
            raise ValueError(f"image {k}: grid {list(grid)} takes {n} image tokens from {start}; the prompt "
                             "has fewer there")
        grid_pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(lh), torch.arange(lw),
                                              indexing="ij"))
        out[:, start : start + n] = grid_pos.reshape(3, n) + pos
        pos += max(h, w) // m
        at = start + n
    if bool(is_image[at:].any()):
        raise ValueError(f"the prompt has image tokens past its {len(image_grids)} images")
    out[:, at:] = torch.arange(pos, pos + n_ids - at)
    delta = int(out.max()) + 1 - n_ids if n_ids else 0
    return out, delta


def mrope_cos_sin(
    rotary: RotaryEmbedding, positions: torch.Tensor, mrope_section: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and signed sin tables [T, 1, head_dim] of tokens at positions [3, T] (RotaryEmbedding.cos_sin's
    layout, which the ops' rotary takes): each frequency's entries from its section's row of the rotary's
    own table (so the same numbers as transformers' mrope cos/sin: position * inv_freq in float32, then cos
    or sin, then the model's dtype)."""
    d = rotary.cos.shape[1]
    if sum(mrope_section) * 2 != d:
        raise ValueError(f"mrope_section {list(mrope_section)} does not cover half the head ({d // 2})")
    rotary.reserve(int(positions.max()) + 1 if positions.numel() else 1)
    rows = [i for i, s in enumerate(mrope_section) for _ in range(s)] * 2  # per entry of the head: its row
    positions = positions.to(rotary.cos.device)
    pick = torch.tensor(rows, device=positions.device).view(1, 1, d).expand(1, positions.shape[1], d)
    cos = torch.take_along_dim(rotary.cos[positions], pick, dim=0)[0]
    sin = torch.take_along_dim(rotary.sin[positions], pick, dim=0)[0]
    return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_mrope(
    x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, mrope_section: Sequence[int], ops: Ops
) -> torch.Tensor:
    """x [T, heads, head_dim] (q or k) rotated by the tokens' positions [3, T]: transformers'
    apply_multimodal_rotary_pos_emb (in 5.x: Qwen2_5_VLRotaryEmbedding's cos/sin through
    apply_rotary_pos_emb). A new tensor."""
    return ops.rotary(x, *mrope_cos_sin(rotary, positions, mrope_section))

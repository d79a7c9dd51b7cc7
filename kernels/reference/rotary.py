"""Rotary position embedding in plain torch, on the tables of worker/layers/rotary.py's RotaryEmbedding: the
path off CPU float32, and what the C kernel (kernels/native/rotary.py) matches bit for bit."""

from __future__ import annotations

import torch


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] (any strides); cos/sin from RotaryEmbedding.cos_sin. Returns a new tensor.

    HF computes ``x * cos + rotate_half(x) * sin`` with rotate_half(x) = [-x2, x1]. With the sign folded
    into the table (sin = [-s, s]) that is ``x * cos + [x2, x1] * sin``, and [x2, x1] is one roll: four
    ops instead of seven, bit-identical to HF (each element sees the same products and the same add).
    """
    out = x * cos
    return out.add_(torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(sin))

"""Rotary position embedding tables, HF "rotate_half" layout (first half of head_dim pairs with second half);
the rotation itself is the ops' (kernels/ops.py)."""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between.
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


class RotaryEmbedding:
    """Holds cos/sin tables [max_pos, head_dim] in the model dtype, grown on demand.

    Tables are computed like HF (fp32 position * inv_freq, then cos/sin, then cast) so fp32 results match.
    They are stored full width, ready for the ops' rotary (kernels/reference/rotary.py): cos as [cos, cos]
    and sin with rotate_half's sign folded in, [-sin, sin].
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.inv_freq = _inv_freq(head_dim, theta, scaling)
        self.dtype, self.device = dtype, device
        self.cos = self.sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def reserve(self, max_positions: int) -> None:
        """Make sure positions < max_positions are in the table (call up front to avoid growth mid-run)."""
        if max_positions <= self.cos.shape[0]:
            return
        n = max(4096, 1 << (max_positions - 1).bit_length())
        freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)
        self.cos = torch.cat((cos, cos), dim=-1).to(self.device)
        self.sin = torch.cat((-sin, sin), dim=-1).to(self.device)  # negation is exact: same numbers as HF

    def cos_sin(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width cos, signed sin of shape [T, 1, head_dim] for broadcasting over heads (see class doc);
        gathered once per step and shared by all layers. max_position: > positions.max()."""
        self.reserve(max_position)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

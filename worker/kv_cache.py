"""Paged KV cache: per-layer K and V pools addressed by slot, plus each request's token -> slot map."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_reqs: int = 256,
        max_context: int = 4096,
    ) -> None:
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        # Zero-filled, not empty: attention pads short requests with slot 0 and masks it out, and a masked
        # score times a NaN left over in uninitialised memory would still poison the output.
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        # Row r, column j: KV slot of token j of the request living in row r. The engine fills it.
        self.req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's K/V ([T, num_kv_heads, head_dim]) into slots `loc` ([T])."""
        self.k[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v[layer].index_copy_(0, loc, v.to(self.dtype))

"""Sampled tokens written into the persistent token buffer, in plain torch (the CPU path, and what
kernels/triton/sample_writeback.py is tested against)."""

from __future__ import annotations

import torch


def write_sampled_ref(
    tokens: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, sampled: torch.Tensor
) -> None:
    """tokens[rows[i], cols[i]] = sampled[i] (rows distinct: one new token per request)."""
    tokens.index_put_((rows, cols), sampled.to(tokens.dtype))


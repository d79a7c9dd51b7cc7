"""A batched write into a 2-D table at (row, column) pairs, in plain torch (the CPU path, and what
kernels/triton/scatter_2d.py is tested against). The worker's two uses: a step's new KV slots into the
block table, and the sampled tokens into the persistent token buffer (docs/architecture.md §4)."""

from __future__ import annotations

import torch


def scatter_2d_ref(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> None:
    """table[rows[k], cols[k]] = values[k] for every k, as one index_put (entries must not collide); values
    of any dtype are cast to the table's."""
    table.index_put_((rows, cols), values.to(table.dtype))

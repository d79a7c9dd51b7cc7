"""Linear layers laid out for tensor parallelism.

Column-parallel layers split the output features across ranks, row-parallel layers split the input
features (and sum the partial results). Only tp_size == 1 is exercised today; the shard arithmetic is here
so that sharded loading needs no model changes later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x @ W.T + b`` where W stacks several logical outputs (q/k/v or gate/up) row-wise.

    Each logical output of size ``output_sizes[i]`` is split evenly over the ranks and rank r keeps slice r
    of every one of them, so every rank's fused output is laid out ``[q_r, k_r, v_r]``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if any(s % tp_size for s in output_sizes):
            raise ValueError(f"output sizes {output_sizes} not divisible by tp_size={tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shard_sizes = [s // tp_size for s in output_sizes]
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        self.weight = _param((sum(self.shard_sizes), input_size), dtype, device)
        self.bias = _param((sum(self.shard_sizes),), dtype, device) if bias else None

    def load_weight(self, tensor: torch.Tensor, shard: int = 0, param: str = "weight") -> None:
        """Copy this rank's slice of the full (unsharded) checkpoint tensor of logical output `shard`."""
        n, off = self.shard_sizes[shard], self.shard_offsets[shard]
        dst = getattr(self, param)
        dst.data[off : off + n].copy_(tensor.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x @ W.T + b`` with W's input features split over ranks; the partial outputs are summed."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} not divisible by tp_size={tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shard_size = input_size // tp_size
        self.weight = _param((output_size, self.shard_size), dtype, device)
        self.bias = _param((output_size,), dtype, device) if bias else None

    def load_weight(self, tensor: torch.Tensor, shard: int = 0, param: str = "weight") -> None:
        if param == "bias":  # the bias is not split; only rank 0 adds it (see forward)
            self.bias.data.copy_(tensor)
        else:
            self.weight.data.copy_(tensor.narrow(1, self.tp_rank * self.shard_size, self.shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Adding the bias on one rank only keeps it counted once after the all-reduce.
        out = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out)
        return out

"""RMSNorm with the same numerics as HF Llama/Qwen (normalize in fp32, scale in the model dtype)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.linear import full_tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        self.weight.data.copy_(full_tensor(tensor))  # replicated on every rank (Qwen3 q/k norms too)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op instead of six small ones; in fp32 it computes x * rsqrt(mean(x^2) + eps) * w
            # like HF (measured bit-identical on CPU). Other dtypes keep HF's cast order below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

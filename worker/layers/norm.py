"""RMSNorm with HF Llama/Qwen's numerics (normalize in fp32, scale in the model dtype), by the ops' norm: on
CPU in float32 one C pass, after the residual add when there is one (kernels/native/norm_act.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.kernels.ops import Ops
from tandem.worker.layers.linear import full_tensor


class RMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str, ops: Ops
    ) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        self.weight.data.copy_(full_tensor(tensor))  # replicated on every rank (Qwen3 q/k norms too)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.add_rms_norm(x, None, self.weight, self.eps)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """h += delta in place (the residual stream takes a layer's output), then this norm of h."""
        return self.ops.add_rms_norm(h, delta, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + w) where checkpoints hold w: the 1 is added once, at load, in float32
    (transformers computes 1.0 + w.float()), and in float32 the norm runs as any RMSNorm (the very products
    transformers computes). In another dtype transformers scales in float32 and rounds once, after: so
    does this (Llama's rounds the normalised x first)."""

    scale32: torch.Tensor | None = None  # 1 + w in float32, for a model in another dtype

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        w = full_tensor(tensor).float() + 1.0
        self.weight.data.copy_(w)
        if self.weight.dtype != torch.float32:
            self.scale32 = w.to(self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale32 is None:
            return super().forward(x)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale32).to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return super().add_forward(h, delta) if self.scale32 is None else self.forward(h.add_(delta))

"""RMSNorm (after a residual add, optionally) and SiLU- or GELU-and-multiply in plain torch: the path off CPU
float32, and what the C kernels (kernels/native/norm_act.py) are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's formula op for op: normalise in float32, scale by the weight last, in the model dtype.
    (Not F.rms_norm: on CPU it is no fused kernel, and measured 10-30x slower at 512-2,048 rows.)"""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(torch.mean(xf * xf, -1, keepdim=True).add_(eps))
    return weight * xf.to(dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += delta in place (when given), then rms_norm_ref of x: the C kernel's signature."""
    return rms_norm_ref(x if delta is None else x.add_(delta), weight, eps)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] -> silu(gate) * up [rows, n], in place on gate_up's first half (a fresh product's)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def gelu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] -> gelu_tanh(gate) * up [rows, n] (HF's gelu_pytorch_tanh: Gemma's GeGLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)

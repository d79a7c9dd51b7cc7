"""RMSNorm (after a residual add, optionally) and SiLU- or GELU-and-multiply on CPU in float32, one C pass
each.

Between a decoder layer's matrix products torch runs RMSNorm as seven ops and SiLU-times-up as three, each
a Python call and a pass over memory; at batch 1 that dispatch is most of the time outside the products.
kernels/csrc/norm_act.c does each in one call (compiled on first use, see kernels/native/build.py). A row's
result depends on that row alone. The plain-torch references, and the path everywhere else (other dtypes,
CUDA, no compiler, TANDEM_NO_NATIVE=1), are kernels/reference/norm_act.py.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem.kernels.native import build as native_build

SOURCE = Path(__file__).parents[1] / "csrc" / "norm_act.c"


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "running RMSNorm and SiLU as torch ops instead")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tandem_add_rms_norm_f32.restype = None
    lib.tandem_add_rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_float, ptr, i64, i64]
    for fn in (lib.tandem_silu_mul_f32, lib.tandem_gelu_mul_f32):
        fn.restype = None
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, i64]
    return lib


def available() -> bool:
    return _library() is not None


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these: float32 CPU matrices with contiguous rows, and the library built."""
    return (
        all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1
            for t in tensors
        )
        and available()
    )


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += delta in place (when given: the residual stream takes a layer's output), then RMSNorm of x, as
    the reference's rms_norm_ref computes it, into a new tensor. x, delta [rows, n]; weight [n] contiguous."""
    lib = _library()
    if lib is None or not supports(x, *(() if delta is None else (delta,))) or not weight.is_contiguous():
        raise ValueError("add_rms_norm takes float32 CPU [rows, n] tensors with contiguous rows")
    rows, n = x.shape
    if weight.shape != (n,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"shapes {tuple(x.shape)}, {None if delta is None else tuple(delta.shape)}, "
                         f"weight {tuple(weight.shape)} do not fit")
    out = x.new_empty(rows, n)
    lib.tandem_add_rms_norm_f32(
        x.data_ptr(),
        x.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        weight.data_ptr(),
        rows,
        n,
        eps,
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] -> silu(gate) * up [rows, n] (a new tensor)."""
    return _act_mul(gate_up, "silu")


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] -> gelu_tanh(gate) * up [rows, n] (a new tensor): Gemma's GeGLU."""
    return _act_mul(gate_up, "gelu")


def _act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    lib = _library()
    if lib is None or not supports(gate_up) or gate_up.shape[1] % 2:
        raise ValueError(f"{act}_mul takes a float32 CPU [rows, 2n] tensor with contiguous rows")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, n)
    fn = lib.tandem_silu_mul_f32 if act == "silu" else lib.tandem_gelu_mul_f32
    fn(gate_up.data_ptr(), gate_up.stride(0), rows, n, out.data_ptr(), n, torch.get_num_threads())
    return out

"""Rotary position embedding on CPU in float32, one C pass (kernels/csrc/rotary.c) instead of torch's four
ops, bit for bit the same (no fused multiply-add). The reference, and the path everywhere else (other
dtypes, CUDA, no compiler, TANDEM_NO_NATIVE=1), is kernels/reference/rotary.py's apply_rotary_ref.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem.kernels.native import build as native_build

SOURCE = Path(__file__).parents[1] / "csrc" / "rotary.c"


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "rotating q and k with torch ops instead")
    if lib is None:
        return None
    return bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the kernel's C signature on a loaded build of SOURCE (the tests load other builds too)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tandem_rotary_f32.restype = None
    lib.tandem_rotary_f32.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, ptr, i64]
    return lib


def available() -> bool:
    return _library() is not None


def supports(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [T, H, D] float32 on CPU with each head's vector contiguous; cos/sin [T, 1, D] float32 tables."""
    return (
        x.dtype == cos.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 3
        and x.stride(2) == 1
        and cos.stride(-1) == 1
        and x.shape[2] % 2 == 0
        and available()
    )


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_ref's result in a new contiguous tensor: x [T, H, D]; cos, sin [T, 1, D] (rows
    contiguous)."""
    lib = _library()
    if lib is None or not supports(x, cos) or sin.dtype != cos.dtype or sin.stride(-1) != 1:
        raise ValueError("rotary takes float32 CPU x [T, H, D] (heads contiguous) and [T, 1, D] tables")
    T, H, D = x.shape
    if cos.shape != (T, 1, D) or sin.shape != (T, 1, D):
        raise ValueError(f"tables {tuple(cos.shape)}, {tuple(sin.shape)} do not fit x {tuple(x.shape)}")
    out = x.new_empty((T, H, D))
    lib.tandem_rotary_f32(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        cos.data_ptr(),
        cos.stride(0),
        sin.data_ptr(),
        sin.stride(0),
        T,
        H,
        D,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out

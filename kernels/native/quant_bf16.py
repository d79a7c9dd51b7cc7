"""A packed GGUF weight as bfloat16, for the products of many rows (a prefill chunk) on a CPU whose bf16
matmuls are hardware (AMX, AVX512-BF16: cpu_caps().fast_bf16): kernels/csrc/quant_bf16.c widens the blocks
to gguf's floats, rounds them to bf16, and torch's product (oneDNN) takes it from there, with x rounded to
bf16 as for a BF16 checkpoint (kernels/cpu_linear.py). A part of the default int8 path (it rounds the
weights too); the exact path never takes it. The reference: quant_pack.dequantize(w).to(torch.bfloat16).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native.quant_pack import QuantRows, QuantWeight
from tandem.kernels.workspace import WORKSPACE

SOURCE = Path(__file__).parents[1] / "csrc" / "quant_bf16.c"
_BF16 = torch.empty(0, dtype=torch.bfloat16)


def build(compiler: str | None = None) -> Path:
    return native_build.build(SOURCE, compiler)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "many rows of a GGUF weight multiplied by the int8 kernel instead")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tandem_dequantize_bf16.restype = i64
    lib.tandem_dequantize_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, i64]
    return lib


def available() -> bool:
    return _library() is not None


def dequantize_bf16(w: QuantWeight | QuantRows, threads: int | None = None) -> torch.Tensor:
    """[out, in] bfloat16: the transposed view of k-major storage (F.linear takes it as it is), valid until
    the next call (a shared buffer)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the bf16 dequantizer is not available")
    parts = w.parts if isinstance(w, QuantRows) else (w,)
    if any(p.dense for p in parts):
        raise ValueError("dequantize_bf16 takes GGUF blocks, not a float weight")
    n, k = sum(p.out_features for p in parts), parts[0].in_features
    # one buffer reused for every layer (kernels/workspace.py): a fresh one is page-faulted in per call, which
    # cost ten times the dequantization itself (measured on a 1B model's 8192 x 2048 layer)
    out = WORKSPACE.get("dequantize_bf16", (k, n), _BF16)
    col = 0
    for p in parts:  # each into its own columns
        rc = lib.tandem_dequantize_bf16(p.data.data_ptr(), p.kind, p.out_features, k,
                                        out.data_ptr() + 2 * col, n, threads or torch.get_num_threads())
        if rc:
            raise MemoryError("dequantize_bf16: out of memory")
        col += p.out_features
    return out.t()

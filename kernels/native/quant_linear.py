"""Linear products on CPU straight from a GGUF file's weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K: the types of llama.cpp's Q4_K_M and Q5_K_M files, among others), or from a float model's float32,
bfloat16 or float16 weight as it is (`dense`: kernels/csrc/dense_rows.h), so every layer of a decode step has
one C entry.

A decode step on CPU is bound by reading the weights: SmolLM2-135M's linear layers are 540 MB in float32
and 66 MB as the file's Q4_1 blocks. kernels/csrc/quant_linear.c dequantizes each weight in registers, to
the very float gguf's own dequantization gives, and multiplies in float32, so the model computes with the
weights of its float32 conversion while reading a sixth of the bytes. Each output is one FMA chain over the
input in order, so a row's result does not depend on the batch it runs in (see the .c file).

With `int8=True` (--cpu-int8-activations) the product takes x quantized per row and 32-block to 8 bits and
multiplies it with the weights' integer q in integer arithmetic (kernels/csrc/quant_int8.h; the reference is
kernels/reference/quant_int8.py): fewer operations a weight, an approximation of the float32 product.

`pack` turns a GGUF tensor's raw blocks into the kernel's layout and `dequantize` is the plain-torch
reference the tests compare with (both in quant_pack.py); `quant_linear` runs the kernel. `available()` is
False (the caller then dequantizes to float32) without a C compiler, when the build fails, or with
TANDEM_NO_NATIVE=1 (kernels/ops.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native.quant_pack import GGUF_BLOCKS, QuantRows, QuantWeight, dense, dequantize, pack

__all__ = ["DENSE_MAX_ROWS", "GGUF_BLOCKS", "QuantRows", "QuantWeight", "available", "build", "dense",
           "dense_takes", "dequantize", "pack", "quant_linear"]

SOURCE = Path(__file__).parents[1] / "csrc" / "quant_linear.c"
# Below this many multiply-adds a call runs on one thread: waking the other costs more than it saves.
PARALLEL_MIN_MACS = 1 << 16
# The most rows a float weight's product takes here; more go to torch (oneDNN). Measured over SmolLM2's 120
# layer shapes (benchmarks/results/worker/README.md): bf16 ahead of oneDNN's AMX product up to 8 rows, float32
# ahead of oneDNN's packed product up to 8 and within 1.2x of it to 128 (and the packed copy is not kept).
# float16 as float32: past it torch multiplies with the weight widened per call (no hardware f16 product
# under float32 activations).
DENSE_MAX_ROWS = {"F32": 128, "BF16": 8, "F16": 128}


def build(compiler: str | None = None) -> Path:
    """This kernel's shared library (see kernels/native/build.py)."""
    return native_build.build(SOURCE, compiler)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "dequantizing the weights to float32 instead")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.tandem_quant_linear_f32, lib.tandem_quant_linear_q8):
        fn.restype = None
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i64]  # x M K ldx w kind N y ldy threads
    lib.tandem_q8_bytes.restype = i64
    lib.tandem_q8_bytes.argtypes = [i64, i64]
    return lib


def q8_bytes(rows: int, in_features: int) -> int:
    """Bytes of `rows` rows of in_features activations quantized for the int8 product (its scratch)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU quantized-linear kernel is not available")
    return int(lib.tandem_q8_bytes(rows, in_features))


def available() -> bool:
    return _library() is not None


def dense_takes(w: QuantWeight, x: torch.Tensor) -> bool:
    """Whether a float weight's product with x runs in the kernel (float32 x of few enough rows)."""
    return x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= DENSE_MAX_ROWS[w.qtype]


def quant_linear(
    x: torch.Tensor, w: QuantWeight | QuantRows, threads: int | None = None, int8: bool = False
) -> torch.Tensor:
    """x [rows, in_features] float32 (rows of any stride, each row contiguous) -> x @ W.T [rows, out];
    int8: with x quantized to 8 bits (the module doc)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU quantized-linear kernel is not available")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"quant_linear takes float32 CPU x [rows, {w.in_features}], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = x.new_empty(m, w.out_features)
    if m == 0:
        return y
    col = 0
    for part in w.parts if isinstance(w, QuantRows) else (w,):  # each into its own columns of y
        macs = m * part.out_features * part.in_features
        n = 1 if macs < PARALLEL_MIN_MACS else (threads or torch.get_num_threads())
        # a float weight (dense) has no blocks to take int8 activations against
        fn = lib.tandem_quant_linear_q8 if int8 and not part.dense else lib.tandem_quant_linear_f32
        fn(x.data_ptr(), m, part.in_features, x.stride(0), part.data.data_ptr(), part.kind, part.out_features,
           y.data_ptr() + col * y.element_size(), y.stride(0), n)
        col += part.out_features
    return y

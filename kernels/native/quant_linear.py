"""Linear products on CPU straight from a GGUF file's 4- and 8-bit weight blocks (Q4_0, Q4_1, Q4_K, Q8_0).

A decode step on CPU is bound by reading the weights: SmolLM2-135M's linear layers are 540 MB in float32
and 66 MB as the file's Q4_1 blocks. kernels/csrc/quant_linear.c dequantizes each weight in registers, to
the very float gguf's own dequantization gives, and multiplies in float32, so the model computes with the
weights of its float32 conversion while reading a sixth of the bytes. Each output is one FMA chain over the
input in order, so a row's result does not depend on the batch it runs in (see the .c file).

`pack` turns a GGUF tensor's raw blocks into the kernel's layout; `dequantize` is the plain-torch
reference the tests compare with; `quant_linear` runs the kernel. `available()` is False (the caller then
dequantizes to float32) without a C compiler, when the build fails, or with TANDEM_NO_NATIVE=1 (kernels/ops.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kernels.native import build as native_build

SOURCE = Path(__file__).parents[1] / "csrc" / "quant_linear.c"
PANEL, KBLK = 16, 32
# GGUF type name -> (the kernel's block kind, weights per GGUF block, bytes per GGUF block). Kinds: 0 = 4-bit
# with float16 d and m, 1 = 8-bit with float16 d, 2 = 4-bit with float32 d and m (see the .c file).
GGUF_BLOCKS = {"Q4_0": (0, 32, 18), "Q4_1": (0, 32, 20), "Q8_0": (1, 32, 34), "Q4_K": (2, 256, 144)}
# Below this many multiply-adds a call runs on one thread: waking the other costs more than it saves.
PARALLEL_MIN_MACS = 1 << 16


@dataclass(frozen=True)
class QuantWeight:
    """A [out_features, in_features] weight in the kernel's layout (see the .c file)."""

    data: torch.Tensor  # uint8 [panels, K / 32, block bytes]
    kind: int  # 0: 4-bit blocks (float16 d, m), 1: 8-bit blocks (float16 d), 2: 4-bit (float32 d, m)
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def build(compiler: str | None = None) -> Path:
    """This kernel's shared library (see kernels/native/build.py)."""
    return native_build.build(SOURCE, compiler)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "dequantizing the weights to float32 instead")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.tandem_quant_linear_f32
    fn.restype = None
    fn.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i64]  # x M K ldx w kind N y ldy threads
    return lib


def available() -> bool:
    return _library() is not None


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of every block, as uint16 bit patterns [rows, blocks]."""
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.uint16)[..., 0]


def _values_and_scales(raw: np.ndarray, qtype: str, n: int, kb: int) -> tuple[np.ndarray, ...]:
    """A GGUF tensor's (q [n, kb, 32] as uint8 bytes, d [n, kb], m [n, kb] or None), 32 weights per block kb:
    d and m as float16 bit patterns (uint16), or float32 for Q4_K."""
    if qtype == "Q4_K":
        import gguf

        sup = raw.reshape(n, kb // 8, 144)
        d, dmin = (_halves(sup, at).view(np.float16).astype(np.float32) for at in (0, 2))
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(sup[..., 4:16]).reshape(-1, 12))
        # d * scale and dmin * min are exact in float32 (11-bit by 6-bit products), as gguf computes them
        scale = d[..., None] * sc.reshape(n, kb // 8, 8).astype(np.float32)
        low = -(dmin[..., None] * mn.reshape(n, kb // 8, 8).astype(np.float32))
        qs = sup[..., 16:].reshape(n, kb // 8, 4, 1, 32)  # 4 x 32 bytes: sub-blocks 2j (low) and 2j+1 (high)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, kb, 32)
        return q, scale.reshape(n, kb), low.reshape(n, kb)
    block = GGUF_BLOCKS[qtype][2]
    blocks = raw.reshape(n, kb, block)
    d = _halves(blocks, 0)
    if qtype == "Q8_0":
        return blocks[..., 2:], d, None
    qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # GGUF's low nibbles are k 0..15
    if qtype == "Q4_1":
        return q, d, _halves(blocks, 2)
    # Q4_0: d * (q - 8) == d * q + (-8 d) exactly (both sides are exact in float32); -8 d must fit a float16.
    m32 = d.view(np.float16).astype(np.float32) * -8.0
    if not (np.abs(m32) <= np.finfo(np.float16).max).all():
        raise ValueError("Q4_0 scale too large to repack")
    return q, d, m32.astype(np.float16).view(np.uint16)


def pack(raw: np.ndarray, qtype: str, in_features: int) -> QuantWeight:
    """raw: a GGUF tensor's blocks as uint8 [out_features, in_features / block weights * block bytes] (gguf's
    reader gives this shape; rows and whole blocks may be sliced off first). Raises ValueError for a type or
    shape the kernel does not take."""
    if qtype not in GGUF_BLOCKS:
        raise ValueError(f"no CPU kernel for GGUF type {qtype}; supported: {', '.join(GGUF_BLOCKS)}")
    kind, elems, block = GGUF_BLOCKS[qtype]
    if in_features % elems or raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] != in_features // elems * block:
        raise ValueError(f"{qtype} weight of {in_features} inputs: expected uint8 rows of "
                         f"{in_features // elems * block} bytes, got {raw.dtype} {tuple(raw.shape)}")
    n, kb = raw.shape[0], in_features // KBLK
    q, d, m = _values_and_scales(raw, qtype, n, kb)
    panels = -(-n // PANEL)
    pad = panels * PANEL - n

    def by_panel(a: np.ndarray) -> np.ndarray:  # [n, kb, ...] -> [panels, kb, ..., 16]
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        a = a.reshape(panels, PANEL, *a.shape[1:])
        return np.moveaxis(a, 1, -1)

    if kind == 1:
        parts = [by_panel(q).reshape(panels, kb, 512)]
    else:
        q = by_panel(q)  # [panels, kb, 32, 16]
        parts = [(q[..., :8] | (q[..., 8:] << 4)).reshape(panels, kb, 256)]
    for f in (d, m) if m is not None else (d,):
        parts.append(np.ascontiguousarray(by_panel(f)).view(np.uint8).reshape(panels, kb, -1))
    data = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return QuantWeight(torch.from_numpy(data), kind, n, in_features)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The reference: the float32 [out, in] weight a packed one stands for (what gguf's dequantization of the
    file gives)."""
    a = w.data.numpy()
    panels, kb, _ = a.shape
    qbytes = 512 if w.kind == 1 else 256

    def field(i: int) -> np.ndarray:  # d (i = 0) or m (i = 1): [panels, kb, 16] float32
        if w.kind == 2:
            return np.ascontiguousarray(a[..., qbytes + 64 * i : qbytes + 64 * (i + 1)]).view(np.float32)
        return np.ascontiguousarray(a[..., qbytes + 32 * i : qbytes + 32 * (i + 1)]).view(np.float16).astype(np.float32)

    d = field(0)
    if w.kind == 1:
        q = a[..., :512].view(np.int8).reshape(panels, kb, 32, 16).astype(np.float32)
        deq = q * d[:, :, None, :]
    else:
        b = a[..., :256].reshape(panels, kb, 32, 8)
        q = np.concatenate([b & 15, b >> 4], axis=-1).astype(np.float32)  # [panels, kb, 32, 16]
        deq = d[:, :, None, :] * q + field(1)[:, :, None, :]
    # [panels, kb, 32 (k), 16 (column)] -> [panels * 16, kb * 32]
    full = deq.transpose(0, 3, 1, 2).reshape(panels * PANEL, kb * KBLK)
    return torch.from_numpy(np.ascontiguousarray(full[: w.out_features]))


def quant_linear(x: torch.Tensor, w: QuantWeight, threads: int | None = None) -> torch.Tensor:
    """x [rows, in_features] float32 (rows of any stride, each row contiguous) -> x @ W.T [rows, out]."""
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
    macs = m * w.out_features * w.in_features
    n = 1 if macs < PARALLEL_MIN_MACS else (threads or torch.get_num_threads())
    lib.tandem_quant_linear_f32(x.data_ptr(), m, w.in_features, x.stride(0), w.data.data_ptr(), w.kind,
                                w.out_features, y.data_ptr(), y.stride(0), n)
    return y

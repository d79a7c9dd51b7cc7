"""A GGUF tensor's blocks read at load time in C (kernels/csrc/quant_repack.c): repacked into the panels of
kernels/csrc/quant_blocks.h (`repack`, the bytes quant_pack.py's numpy `pack_reference` writes, which took
6 to 8 s of a 1B Q4_K_M file's 8 to 10 s start on 2 cores), or dequantized to float32 rows
(`dequantize_rows`, gguf's own floats bit for bit: an embedding table's lookup).

Both take a tensor's raw blocks, uint8 [rows, bytes] (a view whose rows are contiguous is read in place),
and check its shape against the kind (the C code reads every byte the shape claims). `available()` is False
without a C compiler or when the build fails; the callers then run the numpy code.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tandem.kernels.native import build as native_build

SOURCE = Path(__file__).parents[1] / "csrc" / "quant_repack.c"
PANEL = 16  # output rows per panel of quant_blocks.h's layout
# Below this many bytes of blocks a call runs on one thread: waking the others costs more than it saves.
PARALLEL_MIN_BYTES = 1 << 18


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "repacking GGUF blocks with numpy instead")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tandem_repack.restype = i64
    lib.tandem_repack.argtypes = [ptr, i64, i64, i64, i64, ptr, i64]  # raw n ld kind K out threads
    lib.tandem_dequantize_rows.restype = None
    lib.tandem_dequantize_rows.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64]  # ... y ldy threads
    for fn in (lib.tandem_repack_super_bytes, lib.tandem_repack_sub_blocks):
        fn.restype = i64
        fn.argtypes = [i64]
    lib.tandem_repack_row_bytes.restype = i64
    lib.tandem_repack_row_bytes.argtypes = [i64, i64]
    return lib


def available() -> bool:
    return _library() is not None


def _rows(lib: ctypes.CDLL, raw: np.ndarray, kind: int, in_features: int) -> np.ndarray:
    """raw checked, each row contiguous: a slice of whole blocks of a wider tensor stays a view."""
    if not 0 <= kind < 8:
        raise ValueError(f"no GGUF block kind {kind}")
    row = int(lib.tandem_repack_row_bytes(kind, in_features))
    if raw.ndim != 2 or raw.dtype != np.uint8 or row < 0 or raw.shape[1] != row:
        raise ValueError(f"blocks of kind {kind} for {in_features} inputs: expected uint8 rows of {row} "
                         f"bytes, got {raw.dtype} {tuple(raw.shape)}")
    return raw if raw.strides[1] == 1 and raw.strides[0] >= row else np.ascontiguousarray(raw)


def _threads(raw: np.ndarray, threads: int | None) -> int:
    """`threads` as asked; by default torch's, one for a small tensor."""
    if threads:
        return threads
    return 1 if raw.nbytes < PARALLEL_MIN_BYTES else max(1, torch.get_num_threads())


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the C repacking of GGUF blocks is not available")
    return lib


def repack(
    raw: np.ndarray | Sequence[np.ndarray], kind: int, in_features: int, threads: int | None = None
) -> torch.Tensor | None:
    """raw: uint8 [rows, bytes], GGUF blocks of quant_pack.GGUF_BLOCKS' `kind`, or parts of one weight whose
    rows follow each other (a fused q/k or gate/up) -> uint8 [panels, super-blocks, bytes], quant_pack's
    layout; None where a type gguf dequantizes as d * (q - offset) has an infinite or NaN d (quant_pack.pack
    raises). Parts go straight into their panels, not through a joined copy (fresh pages cost as much as the
    repack), where every part but the last fills whole panels."""
    lib = _lib()
    parts = [raw] if isinstance(raw, np.ndarray) else list(raw)
    if any(p.shape[0] % PANEL for p in parts[:-1]):
        parts = [np.concatenate(parts)]
    parts = [_rows(lib, p, kind, in_features) for p in parts]
    n = sum(p.shape[0] for p in parts)
    panels, subs = -(-n // PANEL), int(lib.tandem_repack_sub_blocks(kind))
    out = torch.empty(panels, in_features // 32 // subs, int(lib.tandem_repack_super_bytes(kind)),
                      dtype=torch.uint8)
    if out.numel() == 0:
        return out
    at = 0
    for p in parts:
        if p.shape[0] and lib.tandem_repack(p.ctypes.data, p.shape[0], p.strides[0], kind, in_features,
                                             out[at].data_ptr(), _threads(p, threads)):
            return None
        at += p.shape[0] // PANEL
    return out


def dequantize_rows(
    raw: np.ndarray, kind: int, in_features: int, threads: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """raw as repack's -> float32 [rows, in_features], what gguf.quants.dequantize gives (bit for bit); into
    `out` (float32 CPU, rows contiguous) when given: a table already allocated is not allocated twice."""
    lib = _lib()
    raw = _rows(lib, raw, kind, in_features)
    if out is None:
        out = torch.empty(raw.shape[0], in_features, dtype=torch.float32)
    elif (out.dtype != torch.float32 or out.device.type != "cpu" or out.shape != (raw.shape[0], in_features)
          or out.stride(1) != 1):
        raise ValueError(f"dequantize_rows writes float32 CPU rows [{raw.shape[0]}, {in_features}], got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if out.numel() == 0:
        return out
    lib.tandem_dequantize_rows(raw.ctypes.data, raw.shape[0], raw.strides[0], kind, in_features,
                               out.data_ptr(), out.stride(0), _threads(raw, threads))
    return out

"""LoRA deltas of a step mixing adapters on CPU in float32: kernels/csrc/lora.c, one call per target layer
(compiled on first use, see kernels/native/build.py) where torch's segmented product takes a gather, two
products and a scatter per adapter. The plain-torch twin, and the path everywhere else, is
kernels/reference/lora.py."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.reference.lora import LoraRows, lora_add_ref

SOURCE = Path(__file__).parents[1] / "csrc" / "lora.c"


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "adding LoRA deltas with torch ops instead")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tandem_lora_add_f32.restype = None
    lib.tandem_lora_add_f32.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr,
                                        ptr]
    return lib


def available() -> bool:
    return _library() is not None


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows,
             cols: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """As lora_add_ref, in one C call where it takes the tensors (float32 CPU, contiguous rows and weights);
    else the reference."""
    lib = _library()
    if (lib is None or not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (y, x, a, b))
            or y.dim() != 2 or x.dim() != 2 or y.stride(1) != 1 or x.stride(1) != 1
            or not (a.is_contiguous() and b.is_contiguous())):
        return lora_add_ref(y, x, a, b, rows, cols, ranks)
    slots = rows.slot_of_row
    tmp = torch.empty(y.shape[0], a.shape[1])  # each row's x A^T, between the kernel's two phases
    lib.tandem_lora_add_f32(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), y.shape[0],
                            slots.data_ptr(), a.data_ptr(), b.data_ptr(), a.shape[1], a.shape[2], b.shape[2],
                            cols.data_ptr(), cols.shape[0] - 1, ranks.data_ptr(), tmp.data_ptr())
    return y

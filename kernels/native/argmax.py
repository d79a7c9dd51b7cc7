"""Greedy sampling's argmax on CPU (kernels/csrc/argmax.c): torch.argmax's answer over each row of float32
logits, the CPU step graph's last node (worker/cpu_step_graph.py), so a greedy decode step's tokens come out
of the replay. The reference is torch.argmax itself.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem.kernels.native import build as native_build

SOURCE = Path(__file__).parents[1] / "csrc" / "argmax.c"


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "taking greedy tokens with torch.argmax instead")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tandem_argmax.restype = None
    lib.tandem_argmax.argtypes = [ptr, i64, i64, i64, ptr]
    return lib


def available() -> bool:
    return _library() is not None


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, n] float32 on CPU (rows of any stride, each contiguous; n >= 1) -> [rows] int64,
    logits.argmax(dim=-1)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU argmax kernel is not available")
    if (
        logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.shape[1] < 1
    ):
        raise ValueError(f"argmax takes float32 CPU logits [rows, n >= 1], got {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.tandem_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out

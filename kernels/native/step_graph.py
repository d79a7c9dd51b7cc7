"""The CPU decode-step replayer (kernels/csrc/step_graph.c): a recorded list of kernel calls run with one call.

worker/cpu_step_graph.py records the nodes; this module binds the replayer and hands out the entry points of
the kernels the nodes call (the same ones the eager path calls through their own bindings). `available()`
is False when any of those libraries is missing (no compiler, a failed build, TANDEM_NO_NATIVE=1 is
kernels/ops.py's to honour).
"""

from __future__ import annotations

import ctypes
import functools
import struct
from pathlib import Path

import torch

from tandem.kernels.native import argmax, moe, norm_act, paged_attention, quant_linear, rotary
from tandem.kernels.native import build as native_build

SOURCE = Path(__file__).parents[1] / "csrc" / "step_graph.c"
NODE_ARGS = 24  # as in the .c file: each node is its kind then NODE_ARGS int64 arguments
# Node kinds (the .c file's enum).
EMBED, NORM, HEAD_NORM, QLINEAR, ROTARY, KV_WRITE, ATTENTION, SILU_MUL, MOE, GELU_MUL, ARGMAX = range(11)


def build(compiler: str | None = None) -> Path:
    return native_build.build(SOURCE, compiler)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "running decode steps eagerly")
    if lib is None:
        return None
    fn = lib.tandem_step_graph_run
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return lib


def available() -> bool:
    return _library() is not None and all(
        m.available() for m in (norm_act, paged_attention, quant_linear, rotary, moe, argmax))


@functools.cache
def entry_points() -> dict[str, int]:
    """Kernel name -> address of the C entry point a node calls: the part of the kernel the eager path calls
    (kernels/native/*.py bind those)."""
    # The `_part` entries: thread t of n's share of the eager entry's work (the replayer's one region).
    libs = {
        "add_rms_norm": (norm_act._library(), "tandem_add_rms_norm_part"),
        "silu_mul": (norm_act._library(), "tandem_silu_mul_part"),
        "gelu_mul": (norm_act._library(), "tandem_gelu_mul_part"),
        "quant_linear": (quant_linear._library(), "tandem_quant_linear_part"),
        "quantize_q8": (quant_linear._library(), "tandem_quantize_q8_part"),  # --cpu-int8-activations
        "quant_linear_q8": (quant_linear._library(), "tandem_quant_linear_q8_part"),
        "rotary": (rotary._library(), "tandem_rotary_positions_part"),
        "paged_attention": (paged_attention._library(), "tandem_paged_decode_part"),
        "moe": (moe._library(), "tandem_moe_f32"),  # a whole call, between the replayer's regions
        "argmax": (argmax._library(), "tandem_argmax_part"),
    }
    out = {}
    for name, (lib, symbol) in libs.items():
        if lib is None:
            raise RuntimeError(f"the {name} kernel is not available")
        out[name] = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value or 0
    return out


def float_bits(x: float) -> int:
    """A float argument as the int64 the node holds: its float32 bit pattern (as ctypes' c_float rounds it)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def run(nodes: torch.Tensor, rows: int, threads: int) -> None:
    """Replay nodes [n, NODE_ARGS + 1] int64 over `rows` decode rows."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU step-graph replayer is not available")
    failed = lib.tandem_step_graph_run(nodes.data_ptr(), nodes.shape[0], rows, threads)
    if failed:
        raise MemoryError(f"CPU step graph: node {failed - 1} failed (the attention or MoE kernel's scratch)")

"""The CPU decode-step replayer (kernels/csrc/step_graph.c): a recorded list of kernel calls run with one
call.

worker/step_recorder.py records the nodes; this module names each kind's arguments (`ARGS`: a node is built
by name, `Node`, never packed by position at its call site), binds the replayer and hands out the entry points
of the kernels the nodes call (the same ones the eager path calls through their own bindings). `available()`
is False when any of those libraries is missing (no compiler, a failed build, TANDEM_NO_NATIVE=1 is
kernels/ops.py's to honour).
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.native import argmax, lora, moe, norm_act, paged_attention, quant_linear, rotary
from tandem.kernels.native import build as native_build

SOURCE = Path(__file__).parents[1] / "csrc" / "step_graph.c"
NODE_ARGS = 24  # as in the .c file: each node is its kind then NODE_ARGS int64 arguments
# Node kinds (the .c file's enum).
(EMBED, NORM, HEAD_NORM, QLINEAR, ROTARY, KV_WRITE, ATTENTION, SILU_MUL, MOE, GELU_MUL, ARGMAX, ADD,
 LORA) = range(13)
# Each kind's arguments in the .c file's order: `name*` a pointer (a tensor, a Ptr, or None for 0), `name:f` a
# float32, `@entry` the address of that kernel entry (filled in), else an int64.
_ACT = ("gate_up*", "ldg", "n", "out*", "ldo")
ARGS: dict[int, tuple[str, ...]] = {
    EMBED: ("table*", "hidden", "ids*", "out*", "ld_out", "scale:f"),
    NORM: ("@add_rms_norm", "x*", "ldx", "delta*", "ldd", "w*", "n", "eps:f", "out*", "ldo"),
    HEAD_NORM: ("@add_rms_norm", "x*", "ld_token", "heads", "w*", "D", "eps:f", "out*", "ld_out_token"),
    QLINEAR: (
        "@quant_linear",
        "x*",
        "K",
        "ldx",
        "w*",
        "kind",
        "N",
        "y*",
        "ldy",
        "bias*",
        "min_macs",
        "quantize_part",
        "q8_part",
        "q8*",
    ),
    ROTARY: ("@rotary", "x*", "ldx", "ldh", "cos*", "sin*", "D", "H", "positions*", "out*"),
    KV_WRITE: ("k*", "ldk", "v*", "ldv", "k_pool*", "v_pool*", "width", "slots*", "pool_type"),
    ATTENTION: (
        "@paged_attention",
        "q*",
        "ldq",
        "ldqh",
        "k_pool*",
        "v_pool*",
        "slot_stride",
        "rtt*",
        "ld_rtt",
        "rows*",
        "lens*",
        "slot_buf*",
        "H",
        "Hkv",
        "D",
        "scale:f",
        "out*",
        "work*",
        "work_stride",
        "min_keys",
        "pool_type",
        "window",
        "slot_map*",
    ),
    SILU_MUL: ("@silu_mul", *_ACT),
    MOE: (
        "@moe",
        "x*",
        "H",
        "ldx",
        "router*",
        "E",
        "k",
        "renorm",
        "ids*",
        "wts*",
        "w13*",
        "kind13",
        "N13",
        "w2*",
        "kind2",
        "I",
        "y*",
        "ldy",
    ),
    GELU_MUL: ("@gelu_mul", *_ACT),
    ARGMAX: ("@argmax", "logits*", "ld", "vocab", "out*"),
    ADD: ("x*", "ldx", "delta*", "ldd", "n"),
    LORA: ("@lora_add", "y*", "ldy", "x*", "ldx", "slots*", "a*", "b*", "r", "k", "n", "cols*", "parts",
           "ranks*", "tmp*", "phase"),
}
# Each kind's argument names, without their marks.
NAMES = {k: tuple(a.lstrip("@").rstrip("*").removesuffix(":f") for a in spec) for k, spec in ARGS.items()}


@dataclass(frozen=True)
class Ptr:
    """An address as a recorder may move it: `base`, the start of the buffer it points into (a tensor's
    storage, or a recorder's scratch key), plus `offset` bytes."""

    base: int | str
    offset: int = 0

    @staticmethod
    def of(t: torch.Tensor | None, extra_bytes: int = 0) -> Ptr:
        if t is None:
            return Ptr(0)
        base = t.untyped_storage().data_ptr()
        return Ptr(base, t.data_ptr() - base + extra_bytes)


class Node:
    """One kernel call of a recording: its kind and its arguments by name (checked against ARGS)."""

    def __init__(self, kind: int, /, **args: int | float | Ptr | torch.Tensor | None) -> None:
        given = {n for n, a in zip(NAMES[kind], ARGS[kind], strict=True) if not a.startswith("@")}
        if set(args) != given:
            raise TypeError(
                f"node {kind}: missing {sorted(given - set(args))}, unknown {sorted(set(args) - given)}"
            )
        self.kind = kind
        self.args: list[int | Ptr] = []
        for name, a in zip(NAMES[kind], ARGS[kind], strict=True):
            v = args.get(name)
            if a.startswith("@"):
                self.args.append(entry_points()[name])
            elif a.endswith("*"):
                self.args.append(v if isinstance(v, Ptr) else Ptr.of(v))  # type: ignore[arg-type]
            elif a.endswith(":f"):
                self.args.append(0 if v is None else float_bits(float(v)))  # type: ignore[arg-type]
            else:
                self.args.append(int(v))  # type: ignore[arg-type]

    def arg(self, name: str) -> int | Ptr:
        return self.args[NAMES[self.kind].index(name)]

    def set(self, name: str, value: int | Ptr) -> None:
        self.args[NAMES[self.kind].index(name)] = value

    def pointers(self) -> list[Ptr]:
        return [a for a in self.args if isinstance(a, Ptr)]

    def row(self, address: Callable[[Ptr], int]) -> list[int]:
        """The node as the replayer reads it: kind, then NODE_ARGS int64s (pointers resolved by `address`)."""
        vals = [address(a) if isinstance(a, Ptr) else a for a in self.args]
        return [self.kind, *vals, *[0] * (NODE_ARGS - len(vals))]


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
        m.available() for m in (norm_act, paged_attention, quant_linear, rotary, moe, argmax, lora))


# Kernel name -> (its binding module, the C entry point a node calls): the part of the kernel the eager path
# calls. The `_part` entries: thread t of n's share of the eager entry's work (the replayer's one region).
ENTRIES = {
    "add_rms_norm": (norm_act, "tandem_add_rms_norm_part"),
    "silu_mul": (norm_act, "tandem_silu_mul_part"),
    "gelu_mul": (norm_act, "tandem_gelu_mul_part"),
    "quant_linear": (quant_linear, "tandem_quant_linear_part"),
    "quantize_q8": (quant_linear, "tandem_quantize_q8_part"),  # --cpu-int8-activations
    "quant_linear_q8": (quant_linear, "tandem_quant_linear_q8_part"),
    "rotary": (rotary, "tandem_rotary_positions_part"),
    "paged_attention": (paged_attention, "tandem_paged_decode_part"),
    "moe": (moe, "tandem_moe_f32"),  # a whole call, between the replayer's regions
    "argmax": (argmax, "tandem_argmax_part"),
    "lora_add": (lora, "tandem_lora_add_part"),
}


@functools.cache
def entry_points() -> dict[str, int]:
    """Kernel name -> address of its ENTRIES entry point (kernels/native/*.py bind the same libraries)."""
    out = {}
    for name, (module, symbol) in ENTRIES.items():
        lib = module._library()
        if lib is None:
            raise RuntimeError(f"the {name} kernel is not available")
        out[name] = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value or 0
    return out


def float_bits(x: float) -> int:
    """A float argument as the int64 the node holds: its float32 bit pattern (as ctypes' c_float rounds
    it)."""
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

"""A mixture-of-experts layer on CPU in float32, in one C call (kernels/csrc/moe.c): router product, top-k
routing and the experts' SwiGLU over only the tokens routed to each, with the experts' weights in float32
panels or in a GGUF file's blocks (the quantized linear's layout and tiles, kernels/native/quant_linear.py).

`pack_experts` lays out one matrix of every expert ([E, N, K] float32 or E QuantWeights of one kind),
`pack_router` the router's [E, H]; `moe` runs the layer. The plain-torch reference is
kernels/reference/moe.py. `available()` is False without a C compiler or when the build fails
(kernels/ops.py then runs the reference).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native.quant_pack import PANEL, QuantWeight
from tandem.kernels.native.quant_pack import dequantize as dequantize_blocks

SOURCE = Path(__file__).parents[1] / "csrc" / "moe.c"
F32_KIND = 100  # float32 panels (moe.c's KIND_F32)
MAX_EXPERTS = 1024


def build(compiler: str | None = None) -> Path:
    return native_build.build(SOURCE, compiler)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "running the experts as torch products instead")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tandem_moe_f32.restype = i64
    # x T H ldx router E k renorm ids wts w13 kind13 N13 w2 kind2 I y ldy threads
    lib.tandem_moe_f32.argtypes = [
        ptr,
        i64,
        i64,
        i64,
        ptr,
        i64,
        i64,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i64,
    ]
    return lib


def available() -> bool:
    return _library() is not None


def f32_panels(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] float32 -> [..., ceil(N / 16), K, 16]: panels of 16 output rows, k-major inside (rows past
    N zero)."""
    n, k = w.shape[-2:]
    pad = -n % PANEL
    w = torch.nn.functional.pad(w.float(), (0, 0, 0, pad))
    return w.reshape(*w.shape[:-2], (n + pad) // PANEL, PANEL, k).transpose(-1, -2).contiguous()


@dataclass(frozen=True)
class ExpertWeights:
    """One matrix ([N, K]: gate/up or down) of every expert in the kernel's layout."""

    data: torch.Tensor  # [E, ...]: float32 panels (kind F32_KIND) or quant_blocks.h's bytes
    kind: int
    out_features: int
    in_features: int
    pointers: torch.Tensor  # int64 [E]: each expert's first byte

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The float32 [E, N, K] weights it stands for (the reference's)."""
        if self.kind == F32_KIND:
            return self.data.transpose(-1, -2).reshape(self.num_experts, -1, self.in_features)[
                :, : self.out_features
            ]
        return torch.stack([dequantize_blocks(QuantWeight(d, self.kind, self.out_features, self.in_features))
                            for d in self.data])


def _with_pointers(data: torch.Tensor, kind: int, n: int, k: int) -> ExpertWeights:
    ptrs = torch.tensor([data[e].data_ptr() for e in range(data.shape[0])], dtype=torch.int64)
    return ExpertWeights(data, kind, n, k, ptrs)


def pack_experts(w: torch.Tensor | list[QuantWeight]) -> ExpertWeights:
    """[E, N, K] float32, or E QuantWeights of one kind and shape (an expert's GGUF blocks,
    quant_pack.pack)."""
    if isinstance(w, torch.Tensor):
        return _with_pointers(f32_panels(w), F32_KIND, w.shape[1], w.shape[2])
    if len({(q.kind, q.out_features, q.in_features) for q in w}) != 1:
        raise ValueError("the experts' blocks differ in type or shape")
    return _with_pointers(torch.stack([q.data for q in w]), w[0].kind, w[0].out_features, w[0].in_features)


def pack_router(w: torch.Tensor) -> torch.Tensor:
    """The router's [E, H] weight in float32 panels."""
    return f32_panels(w)


def moe(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    top_k: int,
    renormalize: bool = False,
    router: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] float32 -> (y [T, H], weights [T, k] float32, ids [T, k] int64): routed by `router`
    (pack_router's panels; route_ref's choice) or by the given weights and ids; y is experts_ref's sum."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU MoE kernel is not available")
    e, h, inter = w13.num_experts, w2.out_features, w2.in_features
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != h:
        raise ValueError(
            f"moe takes float32 CPU x [tokens, {h}], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    if w13.in_features != h or w13.out_features != 2 * inter or w2.num_experts != e or not 0 < top_k <= e:
        raise ValueError(f"experts of shapes [{w13.out_features}, {w13.in_features}] and [{h}, {inter}] with "
                         f"top_k {top_k} of {e} do not make a SwiGLU layer")
    if e > MAX_EXPERTS:
        raise ValueError(f"{e} experts: the kernel takes at most {MAX_EXPERTS}")
    if x.stride(1) != 1:
        x = x.contiguous()
    t = x.shape[0]
    if router is None:
        if weights is None or ids is None or ids.shape != (t, top_k) or weights.shape != (t, top_k) or (
                t and not 0 <= int(ids.min()) <= int(ids.max()) < e):
            raise ValueError(
                f"without a router, weights and ids [{t}, {top_k}] with ids below {e} are needed"
            )
        weights = weights.float().contiguous()
        ids = ids.to(torch.int64).contiguous()
    else:
        weights = x.new_empty(t, top_k)
        ids = torch.empty(t, top_k, dtype=torch.int64)
    y = x.new_empty(t, h)
    if t == 0:
        return y, weights, ids
    failed = lib.tandem_moe_f32(
        x.data_ptr(),
        t,
        h,
        x.stride(0),
        0 if router is None else router.data_ptr(),
        e,
        top_k,
        int(renormalize),
        ids.data_ptr(),
        weights.data_ptr(),
        w13.pointers.data_ptr(),
        w13.kind,
        w13.out_features,
        w2.pointers.data_ptr(),
        w2.kind,
        inter,
        y.data_ptr(),
        y.stride(0),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"the MoE kernel could not allocate its scratch for {t} tokens")
    return y, weights, ids

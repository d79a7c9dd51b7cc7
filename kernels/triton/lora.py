"""The Triton kernel of kernels/reference/lora.py's lora_add_ref (same signature): Punica's BGMV, each token
row's x A^T then that times B, with the adapter's slot read per row on the device (-1: the base, skipped), so
a decode step's launches take the same grid whatever its rows run and a CUDA graph captures them once
(worker/decode_graphs.py). Two launches a layer: shrink (x [T, in] -> t [T, R] in float32) and expand (y [T,
out] += t B), each reading only the rows of a and b the row's adapter fills (`ranks`); `cols` is not read:
the zeros of b between a fused layer's parts are summed as they are. Triton
is imported on first use (see input_prep.py for why)."""
from __future__ import annotations

import functools
from typing import Any

import torch

from tandem.kernels.reference.lora import LoraRows

BLOCK_K = 64  # inputs per shrink iteration
BLOCK_N = 64  # outputs per expand program


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows,
                    cols: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """As lora_add_ref, from rows.slot_of_row alone (the rows past its length are left as they are)."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    slots = rows.slot_of_row
    t, r, k, n = slots.numel(), a.shape[1], a.shape[2], b.shape[2]
    if t == 0:
        return y
    shrink, expand = _kernels()
    block_r = max(16, 1 << (r - 1).bit_length())
    tmp = torch.empty(t, r, dtype=torch.float32, device=x.device)
    part = r // (cols.numel() - 1)
    shrink[(t,)](x, x.stride(0), slots, ranks, a, tmp, r, part, k, BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    expand[(t, -(-n // BLOCK_N))](y, y.stride(0), slots, ranks, tmp, b, r, part, n, BLOCK_R=block_r,
                                  BLOCK_N=BLOCK_N)
    return y


tl: Any = None  # bound by _kernels before jitting (triton.jit reads the string annotations)


def _shrink(x_ptr, xs, slot_ptr, rank_ptr, a_ptr, tmp_ptr, R, PART, K, BLOCK_R: tl.constexpr,
            BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        held = (r < R) & (r % PART < tl.load(rank_ptr + s))  # the adapter's rows of each part
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t * xs + k, mask=k < K, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + s * R * K + r[:, None] * K + k[None, :],
                         mask=held[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(tmp_ptr + t * R + r, acc, mask=r < R)


def _expand(y_ptr, ys, slot_ptr, rank_ptr, tmp_ptr, b_ptr, R, PART, N, BLOCK_R: tl.constexpr,
            BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        held = (r < R) & (r % PART < tl.load(rank_ptr + s))
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tv = tl.load(tmp_ptr + t * R + r, mask=r < R, other=0.0)
        bv = tl.load(b_ptr + s * R * N + r[:, None] * N + n[None, :],
                     mask=held[:, None] & (n[None, :] < N), other=0.0).to(tl.float32)
        delta = tl.sum(bv * tv[:, None], axis=0)
        yv = tl.load(y_ptr + t * ys + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * ys + n, (yv + delta).to(y_ptr.dtype.element_ty), mask=n < N)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_shrink), triton.jit(_expand)

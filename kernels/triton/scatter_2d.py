"""The Triton kernel of kernels/reference/scatter_2d.py's scatter_2d_ref (same signature): one launch for
all of a step's writes. Triton is imported on first use (see input_prep.py for why)."""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 1024  # entries per program: a decode batch's tokens or a step's new KV slots in one or a few


def scatter_2d_triton(
    table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor
) -> None:
    """Same as the reference's scatter_2d_ref; `values` may be any dtype (cast in the kernel)."""
    assert table.stride(1) == 1
    n = rows.numel()
    if n:
        _kernel()[(-(-n // BLOCK),)](table, rows, cols, values, n, table.stride(0), BLOCK=BLOCK)


tl: Any = None  # bound by _kernel before jitting (triton.jit reads the string annotations)


def _scatter_kernel(table_ptr, rows_ptr, cols_ptr, vals_ptr, n, stride, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = k < n
    r = tl.load(rows_ptr + k, mask=m).to(tl.int64)  # int64 before the multiply: row * stride may pass 2**31
    c = tl.load(cols_ptr + k, mask=m)
    v = tl.load(vals_ptr + k, mask=m)
    tl.store(table_ptr + r * stride + c, v.to(table_ptr.dtype.element_ty), mask=m)


@functools.cache
def _kernel() -> Any:
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_scatter_kernel, do_not_specialize=["n"])  # n changes every step: one compile

"""The post-sample step of the async pipeline (docs/architecture.md §4): sampled tokens written into the
persistent token buffer on the device, where the next step's input prep reads them with no host round
trip. The Triton kernel of kernels/reference/sample_writeback.py's write_sampled_ref (same signature);
Triton is imported on first use (see input_prep.py for why).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 256  # sampled tokens per program: one program covers a typical decode batch


def write_sampled_triton(
    tokens: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, sampled: torch.Tensor
) -> None:
    """Same as the reference's write_sampled_ref; `sampled` may be any integer dtype (cast in the kernel)."""
    assert tokens.stride(1) == 1
    n = rows.numel()
    if n:
        _kernel()[(-(-n // BLOCK),)](tokens, rows, cols, sampled, n, tokens.stride(0), BLOCK=BLOCK)


tl: Any = None  # bound by _kernel before jitting (triton.jit reads the string annotations)


def _writeback_kernel(tokens_ptr, rows_ptr, cols_ptr, sampled_ptr, n, stride, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    r = tl.load(rows_ptr + i, mask=m).to(tl.int64)  # int64 before the multiply: row * stride may pass 2**31
    c = tl.load(cols_ptr + i, mask=m)
    s = tl.load(sampled_ptr + i, mask=m)
    tl.store(tokens_ptr + r * stride + c, s.to(tokens_ptr.dtype.element_ty), mask=m)


@functools.cache
def _kernel() -> Any:
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_writeback_kernel, do_not_specialize=["n"])  # n changes every step: one compile

"""Device-side input prep (docs/architecture.md §4) as a Triton kernel: a step's flat token arrays gathered
from the persistent request state, with the signature and result of its torch reference in
kernels/reference/input_prep.py (the block table's update is kernels/triton/scatter_2d.py).

Triton is imported and the kernels are jitted on first use, not at import: a CPU-only worker never pays
for it, and TRITON_INTERPRET (read by triton.jit when it decorates) can still be set by tests after this
module was imported.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

PREP_BLOCK = 256  # tokens per loop iteration of a request's program; decodes mask off all but one lane


def prepare_inputs_triton(
    tokens: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    cu_lens: torch.Tensor,
    total: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same as the reference's prepare_inputs_ref: one program per request, looping over its tokens in
    blocks."""
    assert tokens.stride(1) == 1 and req_to_token.stride(1) == 1
    dev = tokens.device
    input_ids = torch.empty(total, dtype=tokens.dtype, device=dev)
    positions = torch.empty(total, dtype=torch.int64, device=dev)
    out_cache_loc = torch.empty(total, dtype=req_to_token.dtype, device=dev)
    b = rows.numel()
    if b and total:
        _kernels()["prep"][(b,)](
            tokens, req_to_token, rows, starts, lens, cu_lens,
            input_ids, positions, out_cache_loc,
            tokens.stride(0), req_to_token.stride(0),
            BLOCK=PREP_BLOCK,
        )
    return input_ids, positions, out_cache_loc


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- kernels (plain functions; jitted by _kernels) ---------------------------------------------------
# `tl` is bound by _kernels before jitting; the string annotations (from __future__) are what
# triton.jit inspects for constexpr, so nothing here needs triton at import time.
tl: Any = None


def _prep_kernel(
    tokens_ptr, table_ptr, rows_ptr, starts_ptr, lens_ptr, cu_ptr,
    ids_ptr, pos_ptr, loc_ptr,
    tok_stride, tab_stride,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.load(starts_ptr + i).to(tl.int64)
    n = tl.load(lens_ptr + i)
    out0 = tl.load(cu_ptr + i)
    # int64 row/start keep row * stride from overflowing int32 on a large table.
    tok_base = tokens_ptr + row * tok_stride + start
    tab_base = table_ptr + row * tab_stride + start
    for off in range(0, n, BLOCK):
        j = off + tl.arange(0, BLOCK)
        m = j < n
        tl.store(ids_ptr + out0 + j, tl.load(tok_base + j, mask=m), mask=m)
        tl.store(pos_ptr + out0 + j, start + j, mask=m)
        tl.store(loc_ptr + out0 + j, tl.load(tab_base + j, mask=m), mask=m)


@functools.cache
def _kernels() -> dict[str, Any]:
    global tl
    import triton
    import triton.language

    tl = triton.language
    # n changes every step: no per-value specialisation (n == 1, n % 16), so one compile serves all.
    return {"prep": triton.jit(_prep_kernel)}

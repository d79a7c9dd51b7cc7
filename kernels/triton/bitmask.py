"""Structured-output logit masking as a Triton kernel: the CUDA path of kernels/reference/bitmask.py (the
layout and the result are the reference's). Triton is imported on first use (see input_prep.py for why).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tandem.kernels.reference.bitmask import check_bitmask

BLOCK = 1024  # vocab entries per program; a 150k vocab is ~150 programs per row


def apply_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Same as the reference's apply_bitmask_ref; one program per (mask row, BLOCK of the vocab)."""
    n = check_bitmask(logits, bitmask, rows)
    vocab = logits.shape[1]
    if n == 0 or vocab == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1
    grid = (n, -(-vocab // BLOCK))
    _kernel()[grid](
        logits,
        bitmask,
        rows if rows is not None else bitmask,  # unread when HAS_ROWS is false
        vocab,
        logits.stride(0),
        bitmask.stride(0),
        HAS_ROWS=rows is not None,
        BLOCK=BLOCK,
    )


tl: Any = None  # bound by _kernel before jitting (triton.jit reads the string annotations)


def _bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab,
    logits_stride,
    bitmask_stride,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i.to(tl.int64)
    # Each lane loads its own word: 32 lanes hit the same address, served from cache.
    word = tl.load(bitmask_ptr + i.to(tl.int64) * bitmask_stride + offs // 32, mask=in_vocab, other=-1)
    banned = ((word >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=in_vocab & banned)


@functools.cache
def _kernel() -> Any:
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_bitmask_kernel)

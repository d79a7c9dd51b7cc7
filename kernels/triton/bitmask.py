"""Structured-output logit masking: set the logits of tokens a grammar disallows to -inf, in place.

The bitmask is xgrammar's layout: int32 [R, >= ceil(V/32)], token t of a row allowed iff bit t % 32 of word
t // 32 is set (words past ceil(V/32) are ignored). Row i of the bitmask masks logits row rows[i] (all of
logits row i when rows is None), so a batch mixing constrained and free requests ships masks only for the
constrained ones. A Triton kernel and a torch reference with the same signature; Triton is imported on
first use (see kernels/input_prep.py for why).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 1024  # vocab entries per program; a 150k vocab is ~150 programs per row


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> int:
    assert logits.dim() == 2 and bitmask.dim() == 2 and bitmask.dtype == torch.int32
    vocab = logits.shape[1]
    # A narrower mask would leave the tail of the vocab unmasked: samplable out-of-grammar tokens.
    assert bitmask.shape[1] * 32 >= vocab, f"bitmask covers {bitmask.shape[1] * 32} < {vocab} tokens"
    n = bitmask.shape[0] if rows is None else rows.numel()
    assert n <= bitmask.shape[0] and (rows is not None or n == logits.shape[0])
    return n


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (rows distinct)."""
    n = _check(logits, bitmask, rows)
    if n == 0:
        return
    vocab = logits.shape[1]
    words = bitmask[:n, : (vocab + 31) // 32]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(n, -1)[:, :vocab].bool()
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = rows.to(device=logits.device, dtype=torch.long)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Same as apply_bitmask_ref; one program per (mask row, BLOCK of the vocab)."""
    n = _check(logits, bitmask, rows)
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


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """The Triton kernel on CUDA, the torch reference elsewhere; bitmask/rows are moved to the logits'
    device if needed."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if rows is not None:
        rows = rows.to(logits.device, non_blocking=True)
    if logits.is_cuda:
        apply_bitmask_triton(logits, bitmask, rows)
    else:
        apply_bitmask_ref(logits, bitmask, rows)


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

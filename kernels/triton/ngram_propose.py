"""Prompt-lookup drafts on the device (speculative decoding): for each row, the longest n-gram
(min_n <= n <= max_n) ending its known tokens that occurred earlier in them (the latest such
occurrence), and the k tokens that followed it, written into the persistent token buffer just past the
known tokens. It runs right after the sampled tokens are written back, so the next step's drafts come
from this step's real token with no host round trip.

A continuation that runs into the end of the known tokens repeats with the match's period (the
sequence is then periodic, so that is what it predicts); a row with no match drafts its last token.
The Triton kernel of kernels/reference/ngram_propose.py's propose_ngram_ref (same signature), imported on
first use. The reference returns how many drafts each row really has; the kernel returns None (reading
its matches back would stall the device queue).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 256  # candidate match positions per loop iteration


def propose_ngram_triton(
    tokens: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, k: int, min_n: int, max_n: int
) -> None:
    """Same as the reference's propose_ngram_ref, but returns None (the match lengths stay on the device):
    one program per row, scanning its tokens in blocks."""
    assert tokens.stride(1) == 1
    b = rows.numel()
    if b:
        _kernel()[(b,)](
            tokens, rows, lens, tokens.stride(0), tokens.shape[1],
            K=k, K_BLOCK=_pow2(k), MIN_N=min_n, MAX_N=max_n, BLOCK=BLOCK,
        )


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


tl: Any = None  # bound by _kernel before jitting (triton.jit reads the string annotations)


def _ngram_kernel(
    tokens_ptr, rows_ptr, lens_ptr, stride, width,
    K: tl.constexpr, K_BLOCK: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)  # int64 before the multiply: row * stride may pass 2**31
    length = tl.load(lens_ptr + b).to(tl.int64)
    base = tokens_ptr + row * stride
    src = length * 0 - 1
    # Shortest n first: a longer n with a match overrides, so the longest one wins.
    for n in tl.static_range(MIN_N, MAX_N + 1):
        best = length * 0 - 1
        for start in range(0, length - n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            ok = i < length - n
            for t in tl.static_range(n):
                a = tl.load(base + i + t, mask=ok, other=-1)
                s = tl.load(base + length - n + t)
                ok = ok & (a == s)
            best = tl.maximum(best, tl.max(tl.where(ok, i, -1), axis=0))
        src = tl.where(best >= 0, best + n, src)
    j = tl.arange(0, K_BLOCK)
    period = tl.where(src >= 0, length - src, 1)
    idx = src + j
    idx = tl.where(idx < length, idx, length - period + (idx - length) % period)
    idx = tl.where(src >= 0, idx, length - 1)
    m = (j < K) & (length + j < width)
    d = tl.load(base + idx, mask=m)
    tl.store(base + length + j, d, mask=m)


@functools.cache
def _kernel() -> Any:
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(_ngram_kernel)

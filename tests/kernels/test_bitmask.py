"""The grammar bitmask: the Triton kernel (interpreted on CPU), the torch reference, every implementation
resolve_ops picks here and xgrammar's own apply_token_bitmask_inplace agree on random masks."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from tandem.kernels.reference.bitmask import apply_bitmask_ref
from tandem.kernels.triton.bitmask import apply_bitmask_triton
from tests.kernels.ops_variants import cpu_triton, ops_variants


def _random_mask(gen: torch.Generator, n: int, words: int, density: float) -> torch.Tensor:
    bits = torch.rand(n, words, 32, generator=gen) < density
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    return (bits.long() * weights).sum(-1).to(torch.int32)  # two's complement: bit 31 is the sign


def _xgr_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    """xgrammar's CPU apply; it indexes bitmask and logits by the same row, so scatter our compact mask."""
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    if rows is None:
        full.copy_(bitmask)
    else:
        full[rows] = bitmask[: len(rows)]
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[1], indices=rows)


@pytest.mark.parametrize(
    "batch,vocab,extra_words,rows",
    [
        (1, 32, 0, None),
        (3, 100, 0, None),  # vocab not a multiple of 32
        (4, 1061, 0, [3, 0]),  # a subset of rows, out of order
        (5, 2051, 2, [4, 1, 2]),  # a wider mask than the vocab needs (padded allocation); 2 blocks
        (2, 77, 0, []),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@cpu_triton
def test_kernel_matches_ref_and_xgrammar(
    batch: int, vocab: int, extra_words: int, rows: list[int] | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + vocab)
    n = batch if rows is None else len(rows)
    bitmask = _random_mask(gen, n, (vocab + 31) // 32 + extra_words, density=0.6)
    if n:
        bitmask[0, 0] = -1  # an all-allowed word next to mixed ones
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    rows_t = None if rows is None else torch.tensor(rows, dtype=torch.int32)

    ref, tri, xg = logits.clone(), logits.clone(), logits.clone()
    apply_bitmask_ref(ref, bitmask, rows_t)
    apply_bitmask_triton(tri, bitmask, rows_t)
    _xgr_apply(xg, bitmask, rows)
    torch.testing.assert_close(tri, ref, rtol=0, atol=0)
    torch.testing.assert_close(xg, ref, rtol=0, atol=0)

    for ops in ops_variants():  # what the runner calls, each way resolve_ops can pick it here
        dispatched = logits.clone()
        ops.apply_bitmask(dispatched, bitmask, rows_t)
        torch.testing.assert_close(dispatched, ref, rtol=0, atol=0)

    # Spelled out bit by bit: -inf exactly where the bit is 0, rows not listed untouched.
    expected = logits.clone()
    for i, r in enumerate(range(batch) if rows is None else rows):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    torch.testing.assert_close(ref, expected, rtol=0, atol=0)


def test_narrow_mask_rejected() -> None:
    logits = torch.zeros(1, 65)
    with pytest.raises(AssertionError):
        apply_bitmask_ref(logits, torch.zeros(1, 2, dtype=torch.int32))

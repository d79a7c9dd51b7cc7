"""The experts of a mixture-of-experts layer as one grouped product per matrix: the CUDA path. Same
contract as kernels/reference/moe.py's `experts_ref`, which the tests compare it with (under
TRITON_INTERPRET=1 on CPU, natively on a GPU).

The (token, slot) pairs are sorted by expert and each expert's group padded to whole blocks of BLOCK_M rows
(`sort_by_expert`, device ops of static shapes). One launch then multiplies every block by its expert's
weight: a program is (block of pairs, block of output columns), reads its expert from block_expert and
gathers its input rows by pair id, so only the tokens routed to an expert meet its weights and the
experts' weights are read where they lie ([E, N, K], no copies). Two launches a layer: gate/up from the
tokens' rows, then down from the SiLU-multiplied rows, scaled by each pair's routing weight; the k rows of
a token are summed last. Nothing is read back to the host, so a decode step with it can be a CUDA graph.
Triton is imported, and the kernel jitted, on first use (see input_prep.py for why).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tandem.kernels.reference.moe import sort_by_expert
from tandem.kernels.reference.norm_act import silu_mul_ref

BLOCK_M = 16  # pairs per program (tl.dot's least tile side): decode batches route few tokens to an expert
BLOCK_N = 64
BLOCK_K = 32


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def grouped(
        a, w, out, pair_ids, block_expert, weights,
        N, K, num_pairs, top_k, s_a, s_we, s_wn, s_o,
        A_BY_TOKEN: tl.constexpr, SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        mb = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(block_expert + mb)
        if e >= 0:  # blocks past the last group (the grid is an upper bound) do nothing
            pair = tl.load(pair_ids + mb * BLOCK_M + tl.arange(0, BLOCK_M))
            ok = pair < num_pairs
            row = pair // top_k if A_BY_TOKEN else pair  # gate/up read the token's row; down, the pair's
            n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                av = tl.load(
                    a + row[:, None] * s_a + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0
                )
                wv = tl.load(
                    w + e * s_we + n[None, :] * s_wn + kk[:, None],
                    mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0,
                )
                acc += tl.dot(av, wv, input_precision="ieee", out_dtype=tl.float32)
            if SCALE:
                acc = acc * tl.load(weights + pair, mask=ok, other=0.0)[:, None]
            tl.store(out + pair[:, None] * s_o + n[None, :], acc.to(out.dtype.element_ty),
                     mask=ok[:, None] & n_ok[None, :])

    return grouped


def _launch(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    weights: torch.Tensor,
    top_k: int,
    by_token: bool,
) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), -(-n // BLOCK_N))
    _kernel()[grid](
        a, w, out, pair_ids, block_expert, weights, n, k, out.shape[0], top_k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_BY_TOKEN=by_token, SCALE=not by_token, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """experts_ref's contract (kernels/reference/moe.py)."""
    t, top_k = ids.shape
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("experts_triton needs rows of x and of every expert's weights contiguous")
    if t == 0:
        return torch.zeros_like(x)
    pair_ids, block_expert = sort_by_expert(ids, w13.shape[0], BLOCK_M)
    pairs = t * top_k
    scale = weights.reshape(-1).float().contiguous()
    h = x.new_empty(pairs, w13.shape[1])
    _launch(x, w13, h, pair_ids, block_expert, scale, top_k, by_token=True)
    act = silu_mul_ref(h)
    # The scaled rows in float32: a token's k of them are summed before the one rounding to x's dtype.
    y = torch.empty(pairs, w2.shape[1], dtype=torch.float32, device=x.device)
    _launch(act, w2, y, pair_ids, block_expert, scale, top_k, by_token=False)
    return y.view(t, top_k, -1).sum(1).to(x.dtype)

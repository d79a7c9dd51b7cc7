"""Paged attention over a slot-addressed KV pool as Triton kernels: the CUDA path. Same layout and
result as kernels/reference/paged_attention.py's `paged_attention_ref`, which the tests compare them with
(under
TRITON_INTERPRET=1 on CPU, natively on a GPU).

Each program reads its request's KV slots through the req_to_token row where they lie (no gather into a
dense copy) and keeps an online softmax (running max and sum), so any sequence length runs in one pass.

- decode (every request has one new token): one program per (request, KV head); the G query heads of the
  KV head are the rows of one tile, so each K/V block is loaded once for the whole group.
- extend (prefill, with or without a cached prefix; decodes mixed in): one program per (request, query
  head, block of BLOCK_M new tokens), causal by absolute position.

A sliding-window layer (WINDOW > 0) starts each program's key loop at its first query's window and masks
the keys before each query's; `slot_map` (a pool of the sliding layers' own) maps each slot read from the
table, so no key outside a window is ever loaded.

Dots run at IEEE precision: fp32 stays exact (no TF32 rounding); bf16 inputs are unaffected.
A q8_0 pool (uint8 blocks, kernels/reference/kv_quant.py: --kv-cache-dtype q8_0) is read through int8 and
float16 pointers into its bytes, each value times its block's scale in float32, and attended in float32
like the reference attends a pool in another dtype than q's.
Triton is imported, and the kernels jitted, on first use (see input_prep.py for why).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK_N = 64  # keys per inner-loop step
BLOCK_M = 32  # new tokens per extend program
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16


def _pow2(n: int, floor: int = MIN_DOT) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def decode(
        q, k_pool, v_pool, out, req_to_token, rows, seq_lens, slot_map,
        s_qt, s_qh, s_kt, s_kh, s_ot, s_oh, s_r2t,
        scale, G: tl.constexpr, D: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        WINDOW: tl.constexpr, MAPPED: tl.constexpr, Q8: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.load(rows + b)
        seq_len = tl.load(seq_lens + b)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < G
        d_ok = d < D
        qo = b * s_qt + (kvh * G + g[:, None]) * s_qh + d[None, :]
        qv = tl.load(q + qo, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if Q8:
            qv = qv.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        lo = tl.maximum(seq_len - WINDOW, 0) if WINDOW > 0 else 0  # the query's first key
        for n0 in range(lo, seq_len, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < seq_len
            slot = tl.load(req_to_token + row * s_r2t + n, mask=n_ok, other=0)
            if MAPPED:
                slot = tl.load(slot_map + slot, mask=n_ok, other=0)
            kv_ok = n_ok[:, None] & d_ok[None, :]
            if Q8:  # each value's int8 and its block's float16 scale, at their bytes in the rows
                blk = slot[:, None] * s_kt + kvh * s_kh + (d[None, :] // 32) * 34
                vals, scales = blk + 2 + d[None, :] % 32, blk
                kb = tl.load((k_pool + vals).to(tl.pointer_type(tl.int8)), mask=kv_ok, other=0).to(tl.float32)
                kb *= tl.load((k_pool + scales).to(tl.pointer_type(tl.float16)), mask=kv_ok,
                              other=0.0).to(tl.float32)
            else:
                kvo = slot[:, None] * s_kt + kvh * s_kh + d[None, :]
                kb = tl.load(k_pool + kvo, mask=kv_ok, other=0.0)
            s = tl.dot(qv, tl.trans(kb), input_precision="ieee", out_dtype=tl.float32) * scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            if Q8:
                vb = tl.load((v_pool + vals).to(tl.pointer_type(tl.int8)), mask=kv_ok, other=0).to(tl.float32)
                vb *= tl.load((v_pool + scales).to(tl.pointer_type(tl.float16)), mask=kv_ok,
                              other=0.0).to(tl.float32)
            else:
                vb = tl.load(v_pool + kvo, mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(vb.dtype), vb, input_precision="ieee", out_dtype=tl.float32
            )
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        oo = b * s_ot + (kvh * G + g[:, None]) * s_oh + d[None, :]
        tl.store(out + oo, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def extend(
        q, k_pool, v_pool, out, req_to_token, rows, seq_lens, extend_lens, cu_lens, slot_map,
        s_qt, s_qh, s_kt, s_kh, s_ot, s_oh, s_r2t,
        scale, G: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        WINDOW: tl.constexpr, MAPPED: tl.constexpr, Q8: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        mb = tl.program_id(2)
        ext = tl.load(extend_lens + b)
        if mb * BLOCK_M < ext:
            row = tl.load(rows + b)
            seq_len = tl.load(seq_lens + b)
            first = tl.load(cu_lens + b)
            kvh = h // G
            m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            d = tl.arange(0, BLOCK_D)
            m_ok = m < ext
            d_ok = d < D
            pos = seq_len - ext + m  # absolute position of each new token: it sees keys 0 .. pos
            qo = (first + m[:, None]) * s_qt + h * s_qh + d[None, :]
            qv = tl.load(q + qo, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            if Q8:
                qv = qv.to(tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            # Keys past this block's last position are masked for every row: stop there.
            end = tl.minimum(seq_len, seq_len - ext + mb * BLOCK_M + BLOCK_M)
            # ... and, with a window, keys before this block's first query's window for every row: start
            # there.
            lo = tl.maximum(seq_len - ext + mb * BLOCK_M - WINDOW + 1, 0) if WINDOW > 0 else 0
            for n0 in range(lo, end, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                n_ok = n < end
                slot = tl.load(req_to_token + row * s_r2t + n, mask=n_ok, other=0)
                if MAPPED:
                    slot = tl.load(slot_map + slot, mask=n_ok, other=0)
                kv_ok = n_ok[:, None] & d_ok[None, :]
                if Q8:  # as the decode kernel reads q8_0 blocks
                    blk = slot[:, None] * s_kt + kvh * s_kh + (d[None, :] // 32) * 34
                    vals, scales = blk + 2 + d[None, :] % 32, blk
                    kb = tl.load((k_pool + vals).to(tl.pointer_type(tl.int8)), mask=kv_ok,
                                 other=0).to(tl.float32)
                    kb *= tl.load((k_pool + scales).to(tl.pointer_type(tl.float16)), mask=kv_ok,
                                  other=0.0).to(tl.float32)
                else:
                    kvo = slot[:, None] * s_kt + kvh * s_kh + d[None, :]
                    kb = tl.load(k_pool + kvo, mask=kv_ok, other=0.0)
                s = tl.dot(qv, tl.trans(kb), input_precision="ieee", out_dtype=tl.float32) * scale
                seen = n_ok[None, :] & (n[None, :] <= pos[:, None])
                if WINDOW > 0:
                    seen = seen & (n[None, :] > pos[:, None] - WINDOW)
                s = tl.where(seen, s, float("-inf"))
                # A padded query row (m >= ext) may see no key at all: keep its max finite.
                m_new = tl.maximum(tl.maximum(m_i, tl.max(s, 1)), -1e30)
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                if Q8:
                    vb = tl.load((v_pool + vals).to(tl.pointer_type(tl.int8)), mask=kv_ok,
                                 other=0).to(tl.float32)
                    vb *= tl.load((v_pool + scales).to(tl.pointer_type(tl.float16)), mask=kv_ok,
                                  other=0.0).to(tl.float32)
                else:
                    vb = tl.load(v_pool + kvo, mask=kv_ok, other=0.0)
                acc = acc * alpha[:, None] + tl.dot(
                    p.to(vb.dtype), vb, input_precision="ieee", out_dtype=tl.float32
                )
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
            l_i = tl.where(m_ok, l_i, 1.0)
            oo = (first + m[:, None]) * s_ot + h * s_oh + d[None, :]
            tl.store(
                out + oo, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :]
            )

    return {"decode": decode, "extend": extend}


def paged_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    *,
    cu_lens: torch.Tensor,
    max_extend: int,
    window: int = 0,
    slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention_ref's contract. cu_lens [B]: first row of each request in q (exclusive prefix sum
    of extend_lens); max_extend: the largest extend length, from the host (1 = every request decodes), so
    launching reads nothing back from the device. window, slot_map: as the reference's."""
    t, h, d = q.shape
    hkv = k_pool.shape[1]
    if q.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride() != k_pool.stride():
        raise ValueError("paged_attention_triton needs unit-stride head_dim and K/V pools of one layout")
    if k_pool.dtype == torch.uint8 and (d % 32 or k_pool.shape[2] != d // 32 * 34):
        raise ValueError(f"a q8_0 pool of rows of {k_pool.shape[2]} bytes for heads of {d} values")
    out = q.new_empty(t, h, d)
    b = req_pool_indices.numel()
    if b == 0 or t == 0:
        return out
    g = h // hkv
    strides = (
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0),
    )
    kern = _kernels()
    # Q8: q8_0 blocks (uint8 pools; q's head size a multiple of 32, which KVCache checked)
    mapped = {"WINDOW": window, "MAPPED": slot_map is not None, "Q8": k_pool.dtype == torch.uint8}
    smap = req_to_token if slot_map is None else slot_map  # any pointer when not MAPPED
    if max_extend == 1:
        kern["decode"][(b, hkv)](
            q, k_pool, v_pool, out, req_to_token, req_pool_indices, seq_lens, smap, *strides, scale,
            G=g, D=d, BLOCK_G=_pow2(g), BLOCK_D=_pow2(d), BLOCK_N=BLOCK_N, **mapped,
        )
    else:
        kern["extend"][(b, h, -(-max_extend // BLOCK_M))](
            q, k_pool, v_pool, out, req_to_token, req_pool_indices, seq_lens, extend_lens, cu_lens, smap,
            *strides, scale, G=g, D=d, BLOCK_M=BLOCK_M, BLOCK_D=_pow2(d), BLOCK_N=BLOCK_N, **mapped,
        )
    return out

"""CPU paged attention for decode and draft-verify rows: K/V read where they lie in the pool.

The torch path gathers every request's K/V into a dense copy per layer before SDPA; at batch 64 that copy
alone was a quarter of a decode step. kernels/cpu_paged_decode.c reads each key and value once, straight
from the pool, for all the query heads that share it. It is C (compiled here on first use with the
system's C compiler, see kernels/native_build.py), called through ctypes, and spreads the requests over
the threads of the OpenMP runtime torch runs on (see the .c file). The reference is
kernels/paged_attention.py.

`available()` is False, and the caller keeps the torch path, when there is no C compiler, the build
fails, or TANDEM_NO_NATIVE=1.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kernels import native_build
from kernels.paged_attention import WORKSPACE, AttentionPlan, attend_extends

SOURCE = Path(__file__).with_suffix(".c")
# Below this many key reads per call (keys x KV heads), one thread: waking another costs more than it
# saves. Above it even one request is split, by KV head: a lone decode is bound by memory latency, and two
# threads keep twice the reads in flight.
PARALLEL_MIN_KEYS = 512


def build(compiler: str | None = None) -> Path:
    """This kernel's shared library (see kernels/native_build.py)."""
    return native_build.build(SOURCE, compiler)


_i64, _f32p, _i64p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "gathering K/V instead")
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the kernel's C signature on a loaded build of SOURCE (the tests load other builds too)."""
    fn = lib.tandem_paged_decode_f32
    fn.restype = None
    fn.argtypes = [
        _f32p, _i64, _i64, _i64p,  # q, row stride, head stride, q rows
        _f32p, _f32p, _i64,  # k pool, v pool, slot stride
        _i64p, _i64, _i64p,  # slots, slots row stride, lens
        _i64, _i64, _i64, _i64, ctypes.c_float,  # q_len, heads, kv heads, head_dim, scale
        _f32p, _i64, _f32p, _i64, _i64,  # out, batch, work, work stride, threads
    ]  # fmt: skip
    return lib


def available() -> bool:
    return _library() is not None


def supports(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """What the kernel handles: float32 on CPU, each head's vector contiguous, pool rows [Hkv, D] dense."""
    return (
        q.dtype == k_pool.dtype == torch.float32
        and q.device.type == k_pool.device.type == "cpu"
        and q.stride(2) == 1
        and k_pool.is_contiguous()
    )


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    q_len: int,
    scale: float,
    q_rows: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] (any row/head strides, D contiguous); k_pool, v_pool [S, Hkv, D] contiguous float32;
    slots [B, L] int64 (each request's slots, L >= its length); lens [B] int64 (keys per request, i.e. the
    position of its last query + 1); q_rows [B * q_len] int64 rows of q (None: rows 0 .. B*q_len-1).
    Returns out [B * q_len, H, D]: request b's query j at row b * q_len + j."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU paged-decode kernel is not available")
    if not supports(q, k_pool) or v_pool.shape != k_pool.shape or not v_pool.is_contiguous():
        raise ValueError("paged_decode takes float32 CPU tensors with contiguous pools and head vectors")
    if slots.dtype != torch.int64 or lens.dtype != torch.int64 or slots.stride(1) != 1:
        raise ValueError("slots and lens must be int64, slots rows contiguous")
    lens = lens.contiguous()
    B = slots.shape[0]
    _, H, D = q.shape
    hkv = k_pool.shape[1]
    out = q.new_empty(B * q_len, H, D)
    if B == 0:
        return out
    lens_l = lens.tolist()
    if min(lens_l) < q_len or max(lens_l) > slots.shape[1] or (q_rows is not None and q_rows.numel() != B * q_len):
        raise ValueError("each request needs q_len <= len <= slots.shape[1], and q_rows B * q_len rows")
    work_stride = H * q_len * -(-max(lens_l) // 8) * 8  # score rows padded to whole blocks of 8 keys
    n = max(1, min(threads or torch.get_num_threads(), B * hkv, sum(lens_l) * hkv // PARALLEL_MIN_KEYS))
    work = WORKSPACE.get("decode_scores", (n * work_stride,), out)  # reused: a fresh one per layer is page-faulted in
    rows = None if q_rows is None else q_rows.contiguous()
    lib.tandem_paged_decode_f32(
        q.data_ptr(), q.stride(0), q.stride(1), None if rows is None else rows.data_ptr(),
        k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0),
        slots.data_ptr(), slots.stride(0), lens.data_ptr(),
        q_len, H, hkv, D, scale, out.data_ptr(), B, work.data_ptr(), work_stride, n,
    )  # fmt: skip
    return out


def paged_attention_cpu(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """paged_attention_ref's contract (best with a plan built by_length=False): the decode and verify
    groups go through the kernel, prefills and chunks through the torch path."""
    out = None
    for g in plan.decode_groups:
        o = paged_decode(
            q, k_pool, v_pool, g.slots.view(g.size, g.max_len), g.lens, g.q_len, scale, q_rows=g.token_idx
        )
        if g.token_idx is None:
            return o  # the whole batch was one group
        if out is None:
            out = q.new_empty(plan.num_tokens, *q.shape[1:])
        out.index_copy_(0, g.token_idx, o)
    if out is None:
        out = q.new_empty(plan.num_tokens, *q.shape[1:])
    return attend_extends(out, q, k_pool, v_pool, plan.extends, scale, new_kv)

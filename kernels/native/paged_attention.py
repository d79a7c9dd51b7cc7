"""CPU paged attention: every query of a step (decodes, draft-verify rows, prefills and prefill chunks)
attended with K/V read where they lie in the pool.

The torch path gathers every request's K/V into a dense copy per layer before SDPA; at batch 64 that copy
alone was a quarter of a decode step, and one SDPA per prompt of a few hundred tokens took 1.3-1.7x this
kernel's time. kernels/csrc/paged_attention.c reads each key and value once per block of queries, straight
from the pool, for all the query heads that share it. It is C (compiled here on first use with the
system's C compiler, see kernels/native/build.py), called through ctypes, and spreads the work over the
threads of the OpenMP runtime torch runs on (see the .c file). The pools may be float32, float16, bfloat16
or q8_0 blocks (--kv-cache-dtype: half the bytes a step reads, or 34 per 32 elements; kernels/reference/
kv_quant.py); queries and sums are float32. The reference is kernels/reference/paged_attention.py.
`store_rows` is the eager K/V write into a q8_0 pool: the step graph's KV_WRITE node's code.

`available()` is False, and kernels/ops.py keeps the torch path, when there is no C compiler or the build
fails.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.reference.kv_quant import BLOCK_BYTES, Q8_0, QK
from tandem.kernels.workspace import WORKSPACE

SOURCE = Path(__file__).parents[1] / "csrc" / "paged_attention.c"
# Below this many key reads per call (key-query pairs x KV heads), one thread: waking another costs more
# than it saves. Above it even one request is split, by KV head: a lone decode is bound by memory latency,
# and two threads keep twice the reads in flight (measured, 3 KV heads: 128 keys 15.3 -> 13.2 us per
# layer, 256 keys 31.4 -> 24.2; 64 keys no faster).
PARALLEL_MIN_KEYS = 256
# A block of queries: G * block query vectors stay in L1 while pass 1 scores them against each key block
# (measured: 4-16 queries 1.4-1.9x SDPA on 128-512-token prompts, 64 only 1.15-1.4x), and their scores
# (at most BLOCK_SCORES floats) stay in L2 between the passes.
BLOCK_SCORES = 64 * 1024
MAX_QUERY_BLOCK = 8
# The pool element types the kernel reads, by its code for each (kv_types.h's KV_F32, KV_F16, KV_BF16,
# KV_Q8_0; a uint8 pool is q8_0 blocks).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, Q8_0: 3}


def build(compiler: str | None = None) -> Path:
    """This kernel's shared library (see kernels/native/build.py)."""
    return native_build.build(SOURCE, compiler)


_i64, _f32p, _i64p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, "gathering K/V instead")
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the kernel's C signatures on a loaded build of SOURCE (the tests load other builds too):
    tandem_paged_attention_win; tandem_paged_attention_kv, the same but for the trailing window (0); and
    tandem_paged_attention_f32, the same but for the pool type (float32) too; and tandem_kv_store."""
    args = [
        _f32p, _i64, _i64, _i64p, _i64p,  # q, row stride, head stride, q rows, q offsets
        _f32p, _f32p, _i64,  # k pool, v pool, slot stride
        _i64p, _i64, _i64p,  # slots, slots row stride, lens
        _i64, _i64, _i64, ctypes.c_float,  # heads, kv heads, head_dim, scale
        _f32p, _i64, _i64, _f32p, _i64, _i64,  # out, batch, query block, work, work stride, threads
    ]
    for fn, extra in ((lib.tandem_paged_attention_f32, []), (lib.tandem_paged_attention_kv, [_i64]),
                      (lib.tandem_paged_attention_win, [_i64, _i64])):
        fn.restype, fn.argtypes = ctypes.c_int, args + extra  # extra: the pools' KV_TYPES code, the window
    lib.tandem_kv_store.restype = ctypes.c_int
    # src, ld, rows, width, pool, slots, KV_TYPES code, threads
    lib.tandem_kv_store.argtypes = [_f32p, _i64, _i64, _i64, _f32p, _i64p, _i64, _i64]
    return lib


def available() -> bool:
    return _library() is not None


def supports(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """What the kernel handles: float32 queries on CPU, each head's vector contiguous, pool rows [Hkv, D]
    dense, in a type of KV_TYPES (q8_0: [Hkv, D / 32 * 34] bytes, D a multiple of 32)."""
    D = q.shape[-1]
    width = D // QK * BLOCK_BYTES if k_pool.dtype == Q8_0 and D % QK == 0 else D
    return (
        q.dtype == torch.float32 and k_pool.dtype in KV_TYPES
        and q.device.type == k_pool.device.type == "cpu"
        and q.stride(2) == 1
        and k_pool.is_contiguous()
        and k_pool.shape[-1] == width
    )


BAD_TENSORS = ("paged_attention takes float32 CPU queries, contiguous head vectors and contiguous K and V "
               "pools of one type: float32, float16, bfloat16 or q8_0 blocks (uint8) of the queries' head "
               "size")

# Elements below which a store runs on one thread (waking others costs more than a decode's few rows).
STORE_PARALLEL_MIN = 1 << 16


def store_rows(pool: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> None:
    """pool[loc[r]] = x[r] rounded or quantized to the pool's type (KV_TYPES), x [T, Hkv, D] float32 on CPU:
    the bytes the step graph's KV_WRITE node stores (and kernels/reference/kv_quant.py's, for q8_0)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    if x.dtype != torch.float32 or pool.dtype not in KV_TYPES or pool.device.type != "cpu":
        raise ValueError("store_rows takes float32 rows into a CPU pool of a type of KV_TYPES")
    rows = x.flatten(1)  # a view for the model's [T, Hkv, D] (heads back to back in a row)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    loc = loc.to(torch.int64).contiguous()
    if not pool.is_contiguous() or loc.numel() != rows.shape[0] or pool[0].numel() != _slot_width(pool, rows):
        raise ValueError("store_rows needs a contiguous pool whose slots take one row of x each")
    if loc.numel() and not 0 <= int(loc.min()) <= int(loc.max()) < pool.shape[0]:  # as index_copy_ checks
        raise IndexError(f"store_rows: a slot outside the pool's {pool.shape[0]}")
    threads = 1 if rows.numel() < STORE_PARALLEL_MIN else torch.get_num_threads()
    rc = lib.tandem_kv_store(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], pool.data_ptr(),
                             loc.data_ptr(), KV_TYPES[pool.dtype], threads)
    if rc:
        raise ValueError(f"a row of {rows.shape[1]} elements is not whole q8_0 blocks")


def _slot_width(pool: torch.Tensor, rows: torch.Tensor) -> int:
    """What one row of `rows` takes in a slot of `pool`, in the pool tensor's elements."""
    n = rows.shape[1]
    return n // QK * BLOCK_BYTES if pool.dtype == Q8_0 else n


def _pools_ok(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    same = (v_pool.shape, v_pool.dtype) == (k_pool.shape, k_pool.dtype)
    return supports(q, k_pool) and same and v_pool.is_contiguous()


@dataclass(frozen=True)
class _Launch:
    """What a call needs beyond its tensors, worked out (and checked) once for the step's requests and the
    layers' shapes: every layer of a step reuses it."""

    shape: tuple[int, int, int, int]  # q's heads and head size, the pool's KV heads and slots
    total: int  # queries
    offsets: torch.Tensor  # [B + 1] request b's queries are offsets[b] .. offsets[b + 1] - 1
    block: int  # queries per work item
    work_stride: int
    threads: int
    work: torch.Tensor


def _prepare(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
    q_lens: list[int], q_rows: torch.Tensor | None, threads: int | None,
) -> _Launch:
    if not _pools_ok(q, k_pool, v_pool):
        raise ValueError(BAD_TENSORS)
    if (
        slots.dtype != torch.int64
        or lens.dtype != torch.int64
        or slots.stride(1) != 1
        or not lens.is_contiguous()
    ):
        raise ValueError("slots and lens must be int64, slots rows and lens contiguous")
    B = slots.shape[0]
    _, H, D = q.shape
    hkv = k_pool.shape[1]
    if H % hkv:
        raise ValueError(f"{H} query heads do not split over {hkv} KV heads")
    lens_l = lens.tolist()
    if len(q_lens) != B or len(lens_l) != B:
        raise ValueError("slots, lens and q_lens must describe the same requests")
    if any(not 0 <= n <= m for n, m in zip(q_lens, lens_l)) or max(lens_l, default=0) > slots.shape[1]:
        raise ValueError("each request needs 0 <= q_len <= len <= slots.shape[1]")
    total = sum(q_lens)
    if q_rows is not None and q_rows.numel() != total:
        raise ValueError("q_rows needs one row per query")
    padded = -(-max(lens_l, default=0) // 8) * 8  # score rows padded to whole blocks of 8 keys
    group = H // hkv
    block = max(1, min(MAX_QUERY_BLOCK, max(q_lens, default=1), BLOCK_SCORES // max(1, group * padded)))
    work_stride = group * block * padded
    pairs = sum(n * m for n, m in zip(q_lens, lens_l))
    items = sum(-(-n // block) for n in q_lens) * hkv
    n = max(1, min(threads or torch.get_num_threads(), items, pairs * hkv // PARALLEL_MIN_KEYS))
    return _Launch(
        (H, D, hkv, k_pool.shape[0]),
        total,
        torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int64),
        block,
        work_stride,
        n,
        WORKSPACE.get("attention_scores", (n * work_stride,), q),  # reused: a fresh one is page-faulted in
    )


def _launch(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
    c: _Launch, scale: float, q_rows: torch.Tensor | None, window: int = 0,
) -> torch.Tensor:
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    H, D, hkv, _ = c.shape
    out = q.new_empty(c.total, H, D)
    if c.total == 0:
        return out
    rc = lib.tandem_paged_attention_win(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        None if q_rows is None else q_rows.data_ptr(),
        c.offsets.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        k_pool.stride(0),
        slots.data_ptr(),
        slots.stride(0),
        lens.data_ptr(),
        H,
        hkv,
        D,
        scale,
        out.data_ptr(),
        slots.shape[0],
        c.block,
        c.work.data_ptr(),
        c.work_stride,
        c.threads,
        KV_TYPES[k_pool.dtype],
        window,
    )
    if rc:
        raise MemoryError("the CPU paged-attention kernel could not allocate its work list")
    return out


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    q_lens: list[int],
    scale: float,
    q_rows: torch.Tensor | None = None,
    threads: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q [T, H, D] float32 (any row/head strides, D contiguous); k_pool, v_pool [S, Hkv, D] contiguous, both
    float32, float16 or bfloat16, or both q8_0 blocks [S, Hkv, D / 32 * 34] uint8; window: keys a query sees,
    its own included (0: all before it);
    slots [B, L] int64 (each request's slots, L >= its length); lens [B] int64 (keys per request, i.e. the
    position of its last query + 1); q_lens: request b's number of queries (its last q_lens[b] positions);
    q_rows [sum(q_lens)] int64 rows of q (None: rows 0 .. sum(q_lens)-1, request by request).
    Returns out [sum(q_lens), H, D]: request b's query j at row sum(q_lens[:b]) + j."""
    if _library() is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    lens = lens.contiguous()
    rows = None if q_rows is None else q_rows.contiguous()
    if window < 0:
        raise ValueError(f"window {window} < 0")
    c = _prepare(q, k_pool, v_pool, slots, lens, q_lens, rows, threads)
    return _launch(q, k_pool, v_pool, slots, lens, c, scale, rows, window)


@dataclass
class CpuAttentionPlan:
    """A step's requests as the kernel takes them, shared by every layer."""

    slots: torch.Tensor  # [B, L] each request's slots (past its length, or before its window: anything)
    lens: torch.Tensor  # [B] keys per request
    q_lens: list[int]  # new tokens per request; the step's tokens are laid out request by request
    launch: _Launch | None = None  # worked out by the first layer (a Python pass per layer cost ~50 us)
    window: int = 0  # keys a query sees (0: all before it)


def plan_cpu_attention(
    req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int], extend_lens: list[int], window: int = 0,
    slot_map: torch.Tensor | None = None,
) -> CpuAttentionPlan:
    """rows: each request's row of req_to_token; seq_lens: its keys; extend_lens: its new tokens; window: a
    sliding-window layer's; slot_map: full slot -> slot of a pool of the sliding layers' own (the columns a
    window reaches are mapped, the others are never read)."""
    width = max(seq_lens, default=0)
    slots = req_to_token[torch.tensor(rows, dtype=torch.int64), :width]
    if slot_map is not None:
        lo = (
            min((max(0, s - e - window + 1) for s, e in zip(seq_lens, extend_lens)), default=0)
            if window
            else 0
        )
        slots[:, lo:] = slot_map[slots[:, lo:]]
    return CpuAttentionPlan(
        slots, torch.tensor(seq_lens, dtype=torch.int64), list(extend_lens), window=window
    )


def paged_attention_cpu(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: CpuAttentionPlan, scale: float
) -> torch.Tensor:
    """The step's attention, q [T, H, D] -> [T, H, D] (the step's K/V already in the pools). The first call
    checks the plan against the shapes; the other layers' calls (same shapes) only check their tensors."""
    c = plan.launch
    if c is None or c.shape != (q.shape[1], q.shape[2], k_pool.shape[1], k_pool.shape[0]):
        c = plan.launch = _prepare(q, k_pool, v_pool, plan.slots, plan.lens, plan.q_lens, None, None)
    elif q.shape[0] != c.total or not _pools_ok(q, k_pool, v_pool):
        raise ValueError(BAD_TENSORS)
    return _launch(q, k_pool, v_pool, plan.slots, plan.lens, c, scale, None, plan.window)

"""The C paged-attention kernel (kernels/csrc/paged_attention.c) against the torch reference and dense
attention, its batch invariance, its float16 and bfloat16 pools, and how it is built and refused."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native import paged_attention as cpu_paged_attention
from tandem.kernels.native.paged_attention import (
    build,
    paged_attention,
    paged_attention_cpu,
    plan_cpu_attention,
)
from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.kv_quant import Q8_0, to_pool
from tandem.kernels.reference.paged_attention import build_attention_plan, paged_attention_ref
from tandem.worker.attention_backend import CpuPlan, select_attention_backend
from tandem.worker.forward_batch import ForwardBatch
from tests.c_kernels import needs_c_kernels
from tests.kernels import test_kv_q8_0 as q8_0
from tests.kernels.portable_build import march_build, portable_build, x86_only
from tests.kernels.test_paged_attention import make_case, naive
from tests.kv_pool import Pool

HAS_CC = native_build.find_compiler() is not None


def paged_decode(q, k_pool, v_pool, slots, lens, q_len: int, scale: float, q_rows=None, threads=None):
    """paged_attention with the same q_len for every request (decodes: 1; verify rows: 1 + K)."""
    return paged_attention(q, k_pool, v_pool, slots, lens, [q_len] * slots.shape[0], scale, q_rows, threads)
# Like the GPU tests: the kernel's own tests need what builds it; the fallback is tested either way.
needs_cc = needs_c_kernels


def _plan(c: dict):
    return build_attention_plan(c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["extend_lens"])


def _cpu_plan(c: dict):
    return plan_cpu_attention(
        c["req_to_token"], c["req_pool_indices"].tolist(), c["seq_lens"].tolist(), c["extend_lens"].tolist()
    )


@needs_cc
# 80: not a multiple of 16; 20: not of 8 either (the portable loops, on any CPU)
@pytest.mark.parametrize("d", [16, 20, 64, 80, 128])
@pytest.mark.parametrize(("hkv", "group"), [(1, 1), (2, 1), (2, 3), (1, 4), (3, 3)])
def test_decodes_match_reference_and_dense(d: int, hkv: int, group: int) -> None:
    reqs = [(s, 1) for s in (1, 2, 7, 8, 9, 16, 17, 33, 100, 150)]
    c = make_case(reqs, hkv, group, seed=d + 10 * hkv + group, d=d)
    args = (c["q"], c["k_pool"], c["v_pool"])
    got = paged_attention_cpu(*args, _cpu_plan(c), c["scale"])
    ref = paged_attention_ref(
        *args,
        c["req_to_token"],
        c["req_pool_indices"],
        c["seq_lens"],
        c["extend_lens"],
        c["scale"],
        plan=_plan(c),
    )
    dense = naive(*args, c["slot_lists"], c["seq_lens"].tolist(), c["extend_lens"].tolist(), c["scale"])
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, dense, atol=2e-6, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize("seed", range(4))
def test_mixed_batch_of_decodes_verifies_and_prefills(seed: int) -> None:
    """Decodes (1 new token), verify rows (1 + K over a prefix), fresh prefills and chunks in one batch,
    one call: each row is right and lands where it belongs."""
    reqs = [(40, 1), (20, 20), (90, 5), (3, 1), (60, 17), (77, 5), (150, 1), (31, 3), (12, 12), (45, 1)]
    g = torch.Generator().manual_seed(seed)
    reqs = [reqs[i] for i in torch.randperm(len(reqs), generator=g).tolist()]
    c = make_case(reqs, hkv=2, group=3, seed=seed, d=64)
    args = (c["q"], c["k_pool"], c["v_pool"])
    got = paged_attention_cpu(*args, _cpu_plan(c), c["scale"])
    dense = naive(*args, c["slot_lists"], c["seq_lens"].tolist(), c["extend_lens"].tolist(), c["scale"])
    torch.testing.assert_close(got, dense, atol=3e-6, rtol=1e-5)


@needs_cc
def test_a_query_is_the_same_whatever_runs_beside_it() -> None:
    """Bitwise: a request decoding alone, in a batch with longer neighbours, on one or two threads, and
    as one row of a verify step at the same position all give the same output (what lets speculative
    decoding on equal it off)."""
    c = make_case([(70, 1), (150, 1), (5, 1), (129, 1)], hkv=2, group=2, seed=3, d=64)
    q, kp, vp = c["q"], c["k_pool"], c["v_pool"]
    table = torch.stack([torch.nn.functional.pad(s, (0, 150 - len(s))) for s in c["slot_lists"]])
    lens = c["seq_lens"]
    together = paged_decode(q, kp, vp, table, lens, 1, c["scale"], threads=2)
    one_thread = paged_decode(q, kp, vp, table, lens, 1, c["scale"], threads=1)
    assert torch.equal(together, one_thread)
    for b in range(4):
        alone = paged_decode(
            q[b : b + 1], kp, vp, table[b : b + 1, : lens[b]], lens[b : b + 1], 1, c["scale"]
        )
        assert torch.equal(alone[0], together[b])
    # Request 0 verifying 4 rows ending at its position 69: its last row is its decode above; the
    # earlier rows equal decodes at positions 66..68.
    qv = torch.randn(4, *q.shape[1:])
    qv[3] = q[0]
    rows = paged_decode(qv, kp, vp, table[:1], lens[:1], 4, c["scale"])
    assert torch.equal(rows[3], together[0])
    for j in range(3):
        n = int(lens[0]) - 3 + j
        dec = paged_decode(qv[j : j + 1], kp, vp, table[:1, :n], torch.tensor([n]), 1, c["scale"])
        assert torch.equal(rows[j], dec[0])


@needs_cc
@pytest.mark.parametrize("d", [64, 20])
def test_a_prompt_gives_the_same_bits_whole_chunked_or_token_by_token(d: int) -> None:
    """Bitwise: a 70-token prompt attended in one call (blocks of queries over two threads), in three
    chunks of a prefill beside other requests, and each of its tokens as a lone decode at its position."""
    c = make_case([(70, 70), (40, 1), (9, 9)], hkv=2, group=3, seed=11, d=d)
    q, kp, vp, scale = c["q"][:70], c["k_pool"], c["v_pool"], c["scale"]
    table, full = c["slot_lists"][0][None], torch.tensor([70])
    whole = paged_attention(q, kp, vp, table, full, [70], scale, threads=2)
    assert torch.equal(whole, paged_attention(q, kp, vp, table, full, [70], scale, threads=1))
    other = c["q"][70:]  # the other requests' rows, attended beside the chunks
    tables = torch.stack([torch.nn.functional.pad(s, (0, 70 - len(s))) for s in c["slot_lists"]])
    lens = c["seq_lens"].clone()
    parts = []
    for a, b in ((0, 23), (23, 24), (24, 70)):
        lens[0] = b
        rows = torch.cat([q[a:b], other])
        out = paged_attention(rows, kp, vp, tables, lens, [b - a, 1, 9], scale)
        parts.append(out[: b - a])
    assert torch.equal(torch.cat(parts), whole)
    for j in range(70):
        one = paged_decode(q[j : j + 1], kp, vp, table[:, : j + 1], torch.tensor([j + 1]), 1, scale)
        assert torch.equal(one[0], whole[j])


@needs_cc
def test_a_lone_request_split_over_threads_by_kv_head_is_the_same() -> None:
    c = make_case([(150, 1)], hkv=8, group=2, seed=8, d=64)  # 1,200 key reads: two threads, four heads each
    table = c["slot_lists"][0][None]
    one = paged_decode(c["q"], c["k_pool"], c["v_pool"], table, c["seq_lens"], 1, c["scale"], threads=1)
    two = paged_decode(c["q"], c["k_pool"], c["v_pool"], table, c["seq_lens"], 1, c["scale"], threads=2)
    assert torch.equal(one, two)


@needs_cc
@x86_only
def test_portable_build_matches_the_reference_and_is_batch_invariant(tmp_path, monkeypatch) -> None:
    lib = cpu_paged_attention.bind(portable_build(cpu_paged_attention.SOURCE, tmp_path))
    monkeypatch.setattr(cpu_paged_attention, "_library", lambda: lib)
    test_decodes_match_reference_and_dense(64, 2, 3)
    test_decodes_match_reference_and_dense(20, 1, 4)
    test_mixed_batch_of_decodes_verifies_and_prefills(0)
    test_a_query_is_the_same_whatever_runs_beside_it()
    test_a_prompt_gives_the_same_bits_whole_chunked_or_token_by_token(64)
    for dtype in (torch.float16, torch.bfloat16):
        test_a_half_pool_gives_the_bits_of_a_float32_pool_of_its_values(dtype, 64)
        test_every_half_value_is_read_exactly(dtype, 8)
    # q8_0 (tests/kernels/test_kv_q8_0.py): each row dequantized as it is read, blocks stored as the reference
    q8_0.test_a_q8_0_pool_gives_the_bits_of_a_float32_pool_of_its_values(64, 2, 7)
    q8_0.test_a_prompt_gives_the_same_bits_whole_chunked_or_token_by_token(9)
    q8_0.test_every_q8_0_value_is_read_exactly(32)
    q8_0.test_the_c_store_gives_the_references_bytes(128)


@needs_cc
@x86_only
def test_the_avx2_build_gives_this_cpus_bits(tmp_path, monkeypatch) -> None:
    """Built for AVX2 only (haswell), the kernel gives this CPU's build's bits: on an AVX-512 CPU pass 2 sums
    a position's query heads together, 16 head dims a register, each lane still its query's chain over the
    keys in order. Mixed batches (prefills, chunks, verify rows, decodes), group sizes 1 to 7, head sizes
    16 to 128 (and 40 and 24: a 16-lane path with an 8-lane tail), windows, float32, half and q8_0 pools
    (head sizes that are multiples of 32)."""
    cases = []
    reqs = [(40, 1), (20, 20), (90, 5), (3, 1), (60, 17), (77, 5), (150, 1), (31, 3), (12, 12), (45, 1)]
    for seed, (group, d) in enumerate([(3, 64), (1, 128), (5, 32), (7, 16), (2, 40), (4, 24)]):
        c = make_case(reqs, hkv=2, group=group, seed=seed, d=d)
        for dtype, window in (
            (torch.float32, 0),
            (torch.float16, 0),
            (torch.bfloat16, 0),
            (torch.float32, 24),
            (Q8_0, 0),
            (Q8_0, 24),
        ):
            if dtype != Q8_0 or d % 32 == 0:
                cases.append((c, to_pool(c["k_pool"], dtype), to_pool(c["v_pool"], dtype), window))

    def run_all() -> list[torch.Tensor]:
        out = []
        for c, k, v, window in cases:
            plan = plan_cpu_attention(
                c["req_to_token"],
                c["req_pool_indices"].tolist(),
                c["seq_lens"].tolist(),
                c["extend_lens"].tolist(),
                window,
            )
            out.append(paged_attention_cpu(c["q"], k, v, plan, c["scale"]))
        return out

    native = run_all()
    lib = cpu_paged_attention.bind(march_build(cpu_paged_attention.SOURCE, tmp_path, "haswell"))
    monkeypatch.setattr(cpu_paged_attention, "_library", lambda: lib)
    for a, b in zip(native, run_all(), strict=True):
        assert torch.equal(a, b)


@needs_cc
# 64: the AVX2 passes (F16C's conversion, bf16's shift); 20: the portable loops, which widen each row first
@pytest.mark.parametrize("d", [64, 20])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_pool_gives_the_bits_of_a_float32_pool_of_its_values(dtype: torch.dtype, d: int) -> None:
    """Widening a half to float32 is exact and the sums are the float32 kernel's, in its order: a float16 or
    bfloat16 pool gives the very bits of a float32 pool holding the same values; so does the reference
    (which widens what it gathers). Kernel against reference: the float32 tolerance of the tests above
    (their sums run in different orders, on the same float32 values)."""
    reqs = [(40, 1), (20, 20), (90, 5), (3, 1), (60, 17), (150, 1), (12, 12)]
    c = make_case(reqs, hkv=2, group=3, seed=d, d=d)
    q, kh, vh = c["q"], c["k_pool"].to(dtype), c["v_pool"].to(dtype)
    got = paged_attention_cpu(q, kh, vh, _cpu_plan(c), c["scale"])
    assert torch.equal(got, paged_attention_cpu(q, kh.float(), vh.float(), _cpu_plan(c), c["scale"]))
    rest = (c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["extend_lens"], c["scale"])
    ref = paged_attention_ref(q, kh, vh, *rest, plan=_plan(c))
    assert ref.dtype == torch.float32
    assert torch.equal(ref, paged_attention_ref(q, kh.float(), vh.float(), *rest, plan=_plan(c)))
    torch.testing.assert_close(got, ref, atol=3e-6, rtol=1e-5)
    # and the rounding is not lost on the way: the float32 pool itself gives other values
    assert not torch.equal(got, paged_attention_cpu(q, c["k_pool"], c["v_pool"], _cpu_plan(c), c["scale"]))


@needs_cc
@pytest.mark.parametrize("d", [8, 4])  # the AVX2 loads and the portable widening
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_half_value_is_read_exactly(dtype: torch.dtype, d: int) -> None:
    """All 65,536 bit patterns (subnormals, infinities and NaNs included) as values: a query with a single
    key gives that key's value times a weight of exactly 1, i.e. the value as the kernel widened it."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).reshape(-1, 1, d)
    n = values.shape[0]
    k_pool = torch.zeros(n, 1, d, dtype=dtype)  # every score 0: softmax weight 1 for the only key
    table = torch.arange(n, dtype=torch.int64)[:, None]
    out = paged_decode(torch.zeros(n, 1, d), k_pool, values, table, torch.ones(n, dtype=torch.int64), 1, 1.0)
    torch.testing.assert_close(out, values.float(), atol=0, rtol=0, equal_nan=True)


@needs_cc
def test_the_float32_entry_keeps_its_signature() -> None:
    """tandem_paged_attention_f32 (bound by name elsewhere) still takes its float32 pools, no type argument,
    and computes what paged_attention does."""
    c = make_case([(30, 1), (50, 3), (9, 9)], hkv=2, group=2, seed=4, d=32)
    q, kp, vp, scale = c["q"], c["k_pool"], c["v_pool"], c["scale"]
    plan = _cpu_plan(c)
    want = paged_attention_cpu(q, kp, vp, plan, scale)
    launch, lib = plan.launch, cpu_paged_attention._library()
    assert launch is not None and lib is not None
    fn = lib.tandem_paged_attention_f32
    assert len(fn.argtypes) == 21 and fn.restype is ctypes.c_int
    out = torch.full_like(want, float("nan"))
    H, D, hkv, _ = launch.shape
    rc = fn(q.data_ptr(), q.stride(0), q.stride(1), None, launch.offsets.data_ptr(), kp.data_ptr(),
            vp.data_ptr(), kp.stride(0), plan.slots.data_ptr(), plan.slots.stride(0), plan.lens.data_ptr(),
            H, hkv, D, scale, out.data_ptr(), plan.slots.shape[0], launch.block, launch.work.data_ptr(),
            launch.work_stride, 1)
    assert rc == 0 and torch.equal(out, want)


@needs_cc
def test_rows_of_q_picked_by_index() -> None:
    c = make_case([(30, 1), (50, 1), (9, 1)], hkv=1, group=2, seed=5, d=32)
    q, kp, vp = c["q"], c["k_pool"], c["v_pool"]
    table = torch.stack([torch.nn.functional.pad(s, (0, 50 - len(s))) for s in c["slot_lists"]])
    order = torch.tensor([2, 0, 1])
    picked = paged_decode(q, kp, vp, table[order], c["seq_lens"][order], 1, c["scale"], q_rows=order)
    plain = paged_decode(q, kp, vp, table, c["seq_lens"], 1, c["scale"])
    assert torch.equal(picked, plain[order])


@needs_cc
def test_refuses_what_it_does_not_handle() -> None:
    c = make_case([(10, 1)], hkv=1, group=1, seed=0)
    table, lens = c["slot_lists"][0][None], c["seq_lens"]
    with pytest.raises(ValueError, match="float32"):
        paged_decode(c["q"].bfloat16(), c["k_pool"].bfloat16(), c["v_pool"].bfloat16(), table, lens, 1, 1.0)
    k, v = c["k_pool"], c["v_pool"]
    for kp, vp in ((k.half(), v.bfloat16()), (k.double(), v.double())):
        with pytest.raises(ValueError, match="of one type: float32, float16, bfloat16 or q8_0"):
            paged_decode(c["q"], kp, vp, table, lens, 1, 1.0)
    with pytest.raises(ValueError, match="int64"):
        paged_decode(c["q"], c["k_pool"], c["v_pool"], table.int(), lens, 1, 1.0)
    with pytest.raises(ValueError, match="q_len <= len"):
        paged_attention(c["q"], c["k_pool"], c["v_pool"], table, lens, [11], 1.0)
    with pytest.raises(ValueError, match="same requests"):
        paged_attention(c["q"], c["k_pool"], c["v_pool"], table, lens, [1, 1], 1.0)


@needs_cc
def test_build_is_cached_and_failures_are_reported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    lib = build()
    assert lib.parent == tmp_path and lib.exists()
    mtime = lib.stat().st_mtime_ns
    assert build() == lib and lib.stat().st_mtime_ns == mtime  # found, not rebuilt
    with pytest.raises(RuntimeError, match="failed"):
        build(compiler="false")  # a "compiler" that exits 1
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no half-written files left behind


def test_no_compiler_is_reported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))  # nothing cached to find
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(RuntimeError, match="no C compiler"):
        build()


def test_backend_uses_the_kernel_for_float32_and_the_torch_path_otherwise() -> None:
    """The kernel runs for a float32 model over a float32, float16 or bfloat16 pool (and matches the torch
    backend on it); a bfloat16 model runs the torch path."""
    assert cpu_paged_attention.available() == HAS_CC  # with a compiler, the kernel must build
    q, k, v = torch.randn(1, 1, 16), torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    cases = ((f32, f32, HAS_CC), (f32, f16, HAS_CC), (f32, bf16, HAS_CC), (bf16, bf16, False))
    for dtype, kv_dtype, native in cases:
        backend = select_attention_backend(resolve_ops("cpu", dtype, "cpu"))
        model = type("M", (), {"config": _Cfg(), "dtype": kv_dtype})()  # Pool's KV takes the model's dtype
        pool = Pool(model, num_slots=64, max_reqs=4)
        row = pool.add(5)
        batch: ForwardBatch = pool.batch([(row, [1], 5)])
        plan = backend.plan(batch, pool.kv)
        assert isinstance(plan, CpuPlan) is native
        got = backend.forward(0, q.to(dtype), k.to(dtype), v.to(dtype), pool.kv, plan, 0.25)
        ref = select_attention_backend(resolve_ops("cpu", dtype, "torch"))
        want = ref.forward(0, q.to(dtype), k.to(dtype), v.to(dtype), pool.kv, ref.plan(batch, pool.kv), 0.25)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_without_the_kernel_the_backend_runs_the_torch_path(monkeypatch) -> None:
    """No kernel (here: TANDEM_NO_NATIVE=1, which only resolve_ops reads): the cpu backend plans and attends
    as `torch` does."""
    monkeypatch.setenv("TANDEM_NO_NATIVE", "1")
    assert not resolve_ops("cpu", torch.float32).native
    model = type("M", (), {"config": _Cfg(), "dtype": torch.float32})()
    pool = Pool(model, num_slots=64, max_reqs=4)
    rows = [pool.add(n) for n in (5, 9)]
    batch = pool.batch([(rows[0], [1], 5), (rows[1], [2], 9)])
    q, k, v = torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    outs = []
    for name in ("cpu", "torch"):
        backend = select_attention_backend(resolve_ops("cpu", torch.float32, name))
        plan = backend.plan(batch, pool.kv)
        assert not isinstance(plan, CpuPlan)
        outs.append(backend.forward(0, q, k, v, pool.kv, plan, 0.25))
    assert torch.equal(outs[0], outs[1])


class _Cfg:
    num_hidden_layers, num_key_value_heads, head_dim = 1, 1, 16

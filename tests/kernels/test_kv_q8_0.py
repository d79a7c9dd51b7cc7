"""--kv-cache-dtype q8_0 in the kernels: the C store (the eager write's and the step graph's KV_WRITE node's)
gives kernels/reference/kv_quant.py's bytes; the C attention over q8_0 pools gives the bits of a float32 pool
holding the dequantized values (AVX-512, AVX2 and portable builds; batches of decodes, verify rows, prefills
and chunks; GQA; windows), and the torch reference attends them to float32 tolerance. The step graph with
q8_0 pools: tests/kernels/test_cpu_step_graph.py; the engine: tests/test_kv_cache_q8_0.py."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.kernels.native import paged_attention as cpu_paged_attention
from tandem.kernels.native import step_graph
from tandem.kernels.native.paged_attention import (
    BAD_TENSORS,
    paged_attention,
    paged_attention_cpu,
    plan_cpu_attention,
    store_rows,
)
from tandem.kernels.reference.kv_quant import BLOCK_BYTES, Q8_0, dequantize_q8_0, quantize_q8_0
from tandem.kernels.reference.paged_attention import paged_attention_ref
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tests.c_kernels import needs_c_kernels
from tests.kernels import test_attention_backends as backends_test
from tests.kernels.ops_variants import cpu_triton, triton_runs
from tests.kernels.test_sliding_window_attention import CASES, _split_pool, naive, windowed_case

pytestmark = needs_c_kernels

REQS = [(40, 1), (20, 20), (90, 5), (3, 1), (60, 17), (150, 1), (12, 12), (33, 3)]  # decodes, verifies, prefills


def edge_rows(width: int, seed: int) -> torch.Tensor:
    """Rows of `width` values that take every path of the quantizer: random blocks from 1e-12 to 1e8 (tiny
    ones get a subnormal or zero scale, huge ones a saturated one), zeros, signed zeros, exact ties of the
    rounding, a lone NaN or infinity in a block, the largest floats."""
    g = torch.Generator().manual_seed(seed)
    n = 96
    x = torch.randn(n, width, generator=g) * torch.logspace(-12, 8, n)[:, None]
    x[0] = 0.0
    x[1] = -0.0
    x[2, :32] = torch.cat([torch.tensor([127.0]), torch.arange(-15, 16) + 0.5])  # d = 1: ties at every half
    x[3, 5] = float("nan")
    x[4, 40 % width] = float("inf")
    x[5, 0] = float("-inf")
    x[6] = torch.finfo(torch.float32).max * torch.sign(torch.randn(width, generator=g))
    x[7, :] = 1e-30  # amax / 127 below half the smallest half: a zero scale
    x[8, :] = 2.0**-24 * 127 * 1.5  # a subnormal scale
    x[9, :] = 65504.0 * 127  # the largest scale exactly
    x[10, :] = 65520.0 * 127  # past it: saturated
    return x


@pytest.mark.parametrize("width", [32, 128])
def test_the_c_store_gives_the_references_bytes(width: int) -> None:
    """Eager store (store_rows) and the step graph's KV_WRITE node, into scattered slots, against
    quantize_q8_0: byte for byte, every other slot untouched (128: enough rows for the store's threads)."""
    x = edge_rows(width, width).repeat(6 if width == 128 else 1, 1)
    rows = x.shape[0]
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(rows + 5, generator=g)[:rows].contiguous()
    want = torch.full((rows + 5, width // 32 * BLOCK_BYTES), 7, dtype=torch.uint8)
    want[slots] = quantize_q8_0(x)
    eager = torch.full_like(want, 7)
    store_rows(eager, slots, x)
    assert torch.equal(eager, want)
    kp, vp = torch.full_like(want, 7), torch.full_like(want, 7)
    neg = -x
    node = [step_graph.KV_WRITE, x.data_ptr(), width, neg.data_ptr(), width, kp.data_ptr(), vp.data_ptr(), width,
            slots.data_ptr(), cpu_paged_attention.KV_TYPES[Q8_0]]
    step_graph.run(torch.tensor([node + [0] * (step_graph.NODE_ARGS + 1 - len(node))]), rows, 1)
    assert torch.equal(kp, want)
    want[slots] = quantize_q8_0(neg)
    assert torch.equal(vp, want)


def test_the_store_refuses_what_it_cannot_write() -> None:
    pool = torch.zeros(8, 1, 34, dtype=Q8_0)
    with pytest.raises(ValueError, match="contiguous pool whose slots take one row"):
        store_rows(pool, torch.tensor([1]), torch.zeros(1, 1, 64))  # 64 values do not fit a slot of 32
    with pytest.raises(IndexError, match="a slot outside the pool's 8"):
        store_rows(pool, torch.tensor([8]), torch.zeros(1, 1, 32))


def _quantized(c: dict) -> tuple[torch.Tensor, ...]:
    """The case's pools as q8_0 blocks, and as float32 pools of the values those hold."""
    kq, vq = quantize_q8_0(c["k_pool"]), quantize_q8_0(c["v_pool"])
    return kq, vq, dequantize_q8_0(kq), dequantize_q8_0(vq)


def _cpu_plan(c: dict, window: int = 0):
    return plan_cpu_attention(c["req_to_token"], c["req_pool_indices"].tolist(), c["seq_lens"].tolist(),
                              c["extend_lens"].tolist(), window=window)


# head sizes 32: one 16-lane pass-2 pair; 96: 64 + 32 lanes; 128: two 64s (AVX-512's pass 2; AVX2's 8-lane)
@pytest.mark.parametrize(("d", "group", "window"), [(32, 1, 0), (96, 3, 0), (128, 4, 16), (64, 2, 7),
                                                    (32, 3, 16), (128, 1, 0)])
def test_a_q8_0_pool_gives_the_bits_of_a_float32_pool_of_its_values(d: int, group: int, window: int) -> None:
    """Dequantizing is exact, so the kernel over q8_0 blocks gives the float32 kernel's bits on their
    values, decodes (values read in place) and multi-query items (values dequantized once per chunk) alike;
    the torch reference (which dequantizes what it gathers) gives its own float32 bits on them too, within
    the float32 tolerance of the kernel's; dense attention agrees. Table entries before each window are
    poisoned (windowed_case): neither reads them."""
    c = windowed_case(REQS, window or 10**6, group, seed=d + group + window, d=d)
    kq, vq, kf, vf = _quantized(c)
    got = paged_attention_cpu(c["q"], kq, vq, _cpu_plan(c, window), c["scale"])
    assert torch.equal(got, paged_attention_cpu(c["q"], kf, vf, _cpu_plan(c, window), c["scale"]))
    rest = (c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["extend_lens"], c["scale"])
    ref = paged_attention_ref(c["q"], kq, vq, *rest, window=window)
    assert torch.equal(ref, paged_attention_ref(c["q"], kf, vf, *rest, window=window))
    torch.testing.assert_close(got, ref, atol=3e-6, rtol=1e-5)
    dense = naive(c["q"], kf, vf, c["slot_lists"], c["seq_lens"].tolist(), c["extend_lens"].tolist(),
                  c["scale"], window or 10**6)
    torch.testing.assert_close(got, dense, atol=3e-6, rtol=1e-5)
    # and the quantization is not lost on the way: the original float32 pools give other values
    assert not torch.equal(got, paged_attention_cpu(c["q"], c["k_pool"], c["v_pool"], _cpu_plan(c, window),
                                                    c["scale"]))


@pytest.mark.parametrize("window", [0, 9])
def test_a_prompt_gives_the_same_bits_whole_chunked_or_token_by_token(window: int) -> None:
    """A 70-token prompt over q8_0 pools in one call (blocks of 8 queries: values dequantized per chunk),
    in chunks, and token by token (decodes: values dequantized as they are loaded): the same bits."""
    c = windowed_case([(70, 70), (40, 1)], window or 10**6, group=3, seed=5 + window, d=64)
    kq, vq, _, _ = _quantized(c)
    q, scale, table = c["q"][:70], c["scale"], c["slot_lists"][0][None]
    whole = paged_attention(q, kq, vq, table, torch.tensor([70]), [70], scale, threads=2, window=window)
    parts = [paged_attention(q[a:b], kq, vq, table, torch.tensor([b]), [b - a], scale, window=window)
             for a, b in ((0, 23), (23, 24), (24, 70))]
    assert torch.equal(torch.cat(parts), whole)
    for j in range(70):
        one = paged_attention(q[j : j + 1], kq, vq, table[:, : j + 1], torch.tensor([j + 1]), [1], scale,
                              window=window)
        assert torch.equal(one[0], whole[j])


@pytest.mark.parametrize("d", [32, 64])  # 32: AVX2 and AVX-512 loads of one block; 64: of two
def test_every_q8_0_value_is_read_exactly(d: int) -> None:
    """Every int8 value under scales from subnormal to the largest half, and a NaN scale: a query with a
    single key gives that key's value times a weight of exactly 1, i.e. the value as the kernel read it."""
    ints = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).view(torch.uint8).view(-1, 32)
    scales = torch.tensor([1.0, 2.0**-24, 6.1e-5, 0.0078125, 3.0, 65504.0, float("nan")], dtype=torch.float16)
    blocks = torch.cat([scales.view(torch.uint8).view(-1, 1, 2).expand(-1, ints.shape[0], 2),
                        ints.expand(len(scales), -1, -1)], -1).reshape(-1, BLOCK_BYTES)
    values = blocks.reshape(-1, 1, d // 32 * BLOCK_BYTES)
    n = values.shape[0]
    k_pool = torch.zeros_like(values)  # every score 0: softmax weight 1 for the only key
    table = torch.arange(n, dtype=torch.int64)[:, None]
    out = paged_attention(torch.zeros(n, 1, d), k_pool, values, table, torch.ones(n, dtype=torch.int64),
                          [1] * n, 1.0)
    torch.testing.assert_close(out, dequantize_q8_0(values), atol=0, rtol=0, equal_nan=True)


def test_pools_of_the_wrong_width_are_refused() -> None:
    c = windowed_case([(20, 1), (9, 9)], 10**6, group=2, seed=1, d=64)
    kq, vq, _, _ = _quantized(c)
    assert "q8_0 blocks" in BAD_TENSORS
    with pytest.raises(ValueError, match="q8_0 blocks"):
        paged_attention_cpu(c["q"][:, :, :32], kq, vq, _cpu_plan(c), 1.0)  # rows of 64 values, queries of 32
    with pytest.raises(ValueError, match="q8_0 blocks"):
        paged_attention_cpu(c["q"], kq, c["v_pool"], _cpu_plan(c), 1.0)


@pytest.mark.parametrize("case", ["decodes", "mixed"])
def test_every_backend_writes_the_same_blocks_and_attends_their_values(case: str) -> None:
    """The `cpu` backend (the C store and kernel), the `torch` one (torch's quantizer, the reference, fresh
    prefills attending their K/V as stored) and `triton` (interpreted) over a q8_0 KVCache, a float32 model:
    the step's K/V written as the same blocks, and the outputs the float32 reference's on the pool's
    values."""
    rng, g = random.Random(4), torch.Generator().manual_seed(4)
    d, hkv, group, reqs = 64, 2, 3, backends_test.CASES[case]
    kv = KVCache(1, backends_test.SLOTS, hkv, d, Q8_0, "cpu", max_reqs=backends_test.ROWS,
                 max_context=backends_test.CTX)
    kv.write(0, torch.arange(backends_test.SLOTS), torch.randn(backends_test.SLOTS, hkv, d, generator=g),
             torch.randn(backends_test.SLOTS, hkv, d, generator=g))
    rows = rng.sample(range(backends_test.ROWS), len(reqs))
    slot_lists = backends_test._layout(rng, reqs)
    for row, slots in zip(rows, slot_lists, strict=True):
        kv.req_to_token[row, : len(slots)] = torch.tensor(slots)
    ext = [e for _, _, e in reqs]
    locs = [x for s, e in zip(slot_lists, ext, strict=True) for x in s[len(s) - e :]]
    batch = ForwardBatch.from_lists([0] * len(locs), locs, rows, [len(s) for s in slot_lists], ext)
    q, k, v = (torch.randn(len(locs), h, d, generator=g) for h in (hkv * group, hkv, hkv))
    start = (kv.k[0].clone(), kv.v[0].clone())
    outs, pools = {}, {}
    for name, backend in backends_test.backends(torch.float32).items():
        kv.k[0].copy_(start[0])
        kv.v[0].copy_(start[1])
        outs[name] = backend.forward(0, q, k, v, kv, backend.plan(batch, kv), d**-0.5)
        pools[name] = (kv.k[0].clone(), kv.v[0].clone())
    assert {"cpu-native", "torch"} <= set(outs) and ("triton" in outs) == triton_runs(torch.device("cpu"))
    want_k, want_v = start[0].clone(), start[1].clone()
    want_k[batch.out_cache_loc], want_v[batch.out_cache_loc] = quantize_q8_0(k), quantize_q8_0(v)
    expected = paged_attention_ref(q, dequantize_q8_0(want_k), dequantize_q8_0(want_v), kv.req_to_token,
                                   batch.req_pool_indices, batch.seq_lens, batch.extend_lens, d**-0.5)
    for name, out in outs.items():
        assert torch.equal(pools[name][0], want_k) and torch.equal(pools[name][1], want_v), name
        atol, rtol = backends_test.TOLERANCE[name]
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@cpu_triton
@pytest.mark.parametrize(("case", "window", "mapped"), [("verify", 7, False), ("mixed", 16, True)])
def test_triton_reads_q8_0_blocks_through_windows_and_slot_maps(case: str, window: int, mapped: bool) -> None:
    """The Triton kernels (interpreted) over q8_0 pools with a window, read through the table or through a
    slot map into a pool of the sliding layers' own: the float32 reference's result on the blocks' values.
    (Natively on a GPU: not run here.)"""
    from tandem.kernels.triton.paged_attention import paged_attention_triton

    c = windowed_case(CASES[case], window, group=2, seed=window, d=64)
    k, v, slot_map = c["k_pool"], c["v_pool"], None
    if mapped:
        c["req_to_token"] = c["req_to_token"].clamp(min=0)
        k, v, slot_map = _split_pool(c, window, seed=window)
    kq, vq = quantize_q8_0(k), quantize_q8_0(v)
    ext = c["extend_lens"]
    got = paged_attention_triton(
        c["q"], kq, vq, c["req_to_token"], c["req_pool_indices"], c["seq_lens"], ext, c["scale"],
        cu_lens=torch.cumsum(ext, 0) - ext, max_extend=int(ext.max()), window=window, slot_map=slot_map,
    )
    want = paged_attention_ref(c["q"], dequantize_q8_0(kq), dequantize_q8_0(vq), c["req_to_token"],
                               c["req_pool_indices"], c["seq_lens"], ext, c["scale"], window=window,
                               slot_map=slot_map)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)

"""The quantized-linear CPU kernel (kernels/csrc/quant_linear.c), for every GGUF type it takes: its
repacking gives back gguf's own dequantization exactly, its products are bit for bit one FMA chain over
those weights in k order and match the float32 reference at every row count on both of its paths, a row's
result is the same bits alone, in any batch, at any stride and on any number of threads, and what it
cannot take is refused with a typed error (and a layer then runs dequantized)."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from tandem.kernels.native import quant_linear as cpu_quant_linear
from tandem.kernels.native.quant_linear import GGUF_BLOCKS, QuantRows, dequantize, pack, quant_linear
from tandem.worker.gguf_weights import GGUFBlocks
from tandem.worker.layers import ColumnParallelLinear
from tests.gguf_files import K_QUANTS, k_quant_blocks
from tests.kernels.portable_build import portable_build, x86_only
from tests.kernels.test_cpu_paged_attention import HAS_CC, needs_cc


def _fit(qtype: str, k: int) -> int:
    """k rounded up to whole blocks of the type (the K-quants' are 256 weights)."""
    elems = GGUF_BLOCKS[qtype][1]
    return -(-k // elems) * elems


def _blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:  # gguf cannot quantize to them: random blocks
        return k_quant_blocks(qtype, n, k, seed)
    # rows of different scales, and an offset so Q4_1's minimum is not always ~ -max
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3, (n, 1)).astype(np.float32)
    w += rng.uniform(-0.5, 0.5, (n, 1)).astype(np.float32)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def _gguf_dequant(raw: np.ndarray, qtype: str, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(-1, k))


@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
@pytest.mark.parametrize(("n", "k"), [(1, 32), (16, 64), (37, 96), (130, 32)])
def test_repacking_keeps_gguf_dequantization_exactly(qtype: str, n: int, k: int) -> None:
    k = _fit(qtype, k)
    raw = _blocks(qtype, n, k, seed=n + k)
    w = pack(raw, qtype, k)
    assert (w.out_features, w.in_features) == (n, k)
    assert torch.equal(dequantize(w), _gguf_dequant(raw, qtype, k))


def _fma_chain(x: torch.Tensor, w: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] @ w [out, K].T as one float32 FMA chain per output over k in order, from 0 (or from
    `start` [rows, out]), computed without the kernel: each step's exact x * w + acc (x * w is exact in
    float64) summed in float64 rounded to odd, which rounds to float32 as the exact sum would (a correctly
    rounded FMA)."""
    xs, ws = x.double().numpy(), w.double().numpy()
    acc = np.zeros((xs.shape[0], ws.shape[0])) if start is None else start.double().numpy().copy()
    for k in range(xs.shape[1]):
        p = xs[:, k, None] * ws[None, :, k]
        s = p + acc
        t = s - p
        err = (p - (s - t)) + (acc - t)  # the exact sum is s + err (TwoSum)
        even = (s.view(np.int64) & 1) == 0
        s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        acc = s.astype(np.float32).astype(np.float64)
    return torch.from_numpy(acc.astype(np.float32))


@needs_cc
@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
@pytest.mark.parametrize(("n", "k"), [(16, 32), (37, 96), (70, 256), (200, 288), (21, 768)])
def test_products_match_the_float32_reference(qtype: str, n: int, k: int) -> None:
    """N not a multiple of 16 (the last panel part-filled), several K (1 to 3 K-quant super-blocks)."""
    k = _fit(qtype, k)
    raw = _blocks(qtype, n, k, seed=3)
    w = pack(raw, qtype, k)
    ref_w = _gguf_dequant(raw, qtype, k)
    g = torch.Generator().manual_seed(n)
    # 1-15 rows: weights dequantized in registers; 16 and more: through the float32 scratch; 150: two row
    # blocks
    for rows in (*range(1, 21), 64, 150):
        x = torch.randn(rows, k, generator=g)
        got = quant_linear(x, w).double()
        want = x.double() @ ref_w.double().T
        # float32 rounding over k products: bounded by a small multiple of sum |x_i w_i| per output
        scale = x.double().abs() @ ref_w.double().abs().T
        assert ((got - want).abs() <= 1e-5 * scale + 1e-30).all(), rows


@needs_cc
@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
def test_products_are_one_fma_chain_over_gguf_weights_bit_for_bit(qtype: str) -> None:
    """The contract itself: each output is the float32 FMA chain over k in order on gguf's dequantized
    weights, to the bit, on both paths and on 1 and 2 threads."""
    n, k = 37, _fit(qtype, 288)
    raw = _blocks(qtype, n, k, seed=11)
    want_w = _gguf_dequant(raw, qtype, k)
    w = pack(raw, qtype, k)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(6))
    want = _fma_chain(x, want_w)
    for rows in (1, 3, 4, 16, 20):
        for threads in (1, 2):
            assert torch.equal(quant_linear(x[:rows], w, threads=threads), want[:rows]), (rows, threads)


@needs_cc
@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_thread_count(qtype: str) -> None:
    k, n = _fit(qtype, 96), 70
    w = pack(_blocks(qtype, n, k, seed=9), qtype, k)
    wide = torch.randn(150, k + 32, generator=torch.Generator().manual_seed(1))
    x = wide[:, 5 : 5 + k]  # rows at a stride: read in place
    full = quant_linear(x, w)
    assert torch.equal(full, quant_linear(x.contiguous(), w))
    assert torch.equal(full, quant_linear(x, w, threads=1))
    for a, b in ((0, 1), (17, 18), (3, 10), (40, 53), (100, 150), (0, 64), (20, 150)):
        assert torch.equal(quant_linear(x[a:b], w), full[a:b]), (a, b)


@needs_cc
@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
def test_threads_split_the_panels_without_changing_a_bit(qtype: str) -> None:
    """38 panels over 1 and 2 threads (pairs of panels for few rows, single ones for many: a thread's range
    ends in a 2-panel tile), for 1 to 20 rows: the same bits each way, and right."""
    k, n = _fit(qtype, 128), 600
    raw = _blocks(qtype, n, k, seed=5)
    w, ref_w = pack(raw, qtype, k), _gguf_dequant(raw, qtype, k)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(2))
    many = quant_linear(x, w, threads=2)
    assert torch.equal(many, quant_linear(x, w, threads=1))
    for rows in (1, 2, 3, 4, 7):
        one, two = quant_linear(x[:rows], w, threads=1), quant_linear(x[:rows], w, threads=2)
        assert torch.equal(one, two) and torch.equal(two, many[:rows]), rows
    scale = x.double().abs() @ ref_w.double().abs().T
    assert ((many.double() - x.double() @ ref_w.double().T).abs() <= 1e-5 * scale + 1e-30).all()


@needs_cc
def test_blocks_sliced_on_block_edges_stay_blocks() -> None:
    raw = _blocks("Q4_1", 24, 128)
    blocks = GGUFBlocks(raw, "Q4_1", 128)
    full = blocks.dequantize()
    assert torch.equal(full, _gguf_dequant(raw, "Q4_1", 128))
    part = blocks[4:20, 32:96]
    assert isinstance(part, GGUFBlocks) and part.shape == (16, 64)
    assert torch.equal(part.dequantize(), full[4:20, 32:96])
    x = torch.randn(3, 64)
    torch.testing.assert_close(quant_linear(x, pack(part.raw, "Q4_1", 64)), x @ full[4:20, 32:96].T)
    off_edge = blocks[:, 16:80]  # not on block edges: dequantized
    assert isinstance(off_edge, torch.Tensor) and torch.equal(off_edge, full[:, 16:80])
    k4 = GGUFBlocks(_blocks("Q4_K", 8, 768), "Q4_K", 768)  # Q4_K's blocks are 256 weights
    full4 = k4.dequantize()
    part4 = k4[2:6, 256:768]
    assert isinstance(part4, GGUFBlocks) and torch.equal(part4.dequantize(), full4[2:6, 256:768])
    assert isinstance(k4[:, 32:288], torch.Tensor)  # 32 is a Q4_1 edge, not a Q4_K one


def test_what_the_kernel_does_not_take_is_refused() -> None:
    raw = _blocks("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="no CPU kernel for GGUF type Q3_K"):
        pack(raw, "Q3_K", 64)
    with pytest.raises(ValueError, match="expected uint8 rows of 68 bytes"):
        pack(raw[:, :34], "Q8_0", 64)
    with pytest.raises(ValueError, match="expected uint8 rows"):
        pack(raw, "Q8_0", 48)  # not a whole number of blocks
    if HAS_CC:
        w = pack(raw, "Q8_0", 64)
        with pytest.raises(ValueError, match="float32 CPU x"):
            quant_linear(torch.randn(2, 64).bfloat16(), w)
        with pytest.raises(ValueError, match=r"x \[rows, 64\]"):
            quant_linear(torch.randn(2, 32), w)
        assert quant_linear(torch.randn(0, 64), w).shape == (0, 16)


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    assert cpu_quant_linear.available() == HAS_CC


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q6_K"])
def test_a_scale_the_fused_form_cannot_give_falls_back_to_float32(qtype: str) -> None:
    """gguf's d * (q - offset) is rebuilt as D * q + M with M = -offset * D in float32: exact for any finite
    d (60000 too, which a float16 M could not hold), but for an infinite d gguf gives +-inf where that
    gives NaN: such a weight is refused, and a layer given it dequantizes it instead."""
    k = _fit(qtype, 64)
    raw = _blocks(qtype, 16, k)
    at = 208 if qtype == "Q6_K" else 0  # row 0, first block: d
    raw[0, at : at + 2] = np.array([60000.0], np.float16).view(np.uint8)
    want = _gguf_dequant(raw, qtype, k)
    assert torch.equal(dequantize(pack(raw, qtype, k)), want) and want.abs().max() > 1e5
    if HAS_CC:
        x = torch.randn(3, k)
        assert torch.equal(quant_linear(x, pack(raw, qtype, k)), _fma_chain(x, want))
    raw[0, at : at + 2] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="infinite or NaN scale"):
        pack(raw, qtype, k)
    layer = ColumnParallelLinear(k, [16], bias=False, dtype=torch.float32, device="cpu")
    layer.load_weight(GGUFBlocks(raw, qtype, k))
    with np.errstate(invalid="ignore"):  # gguf's inf * 0
        layer.finish_loading()
        want = _gguf_dequant(raw, qtype, k).numpy()
    assert layer.quant is None and layer.weight is not None and torch.isinf(layer.weight[0]).any()
    np.testing.assert_array_equal(layer.weight.numpy(), want)  # NaN where gguf has NaN


@needs_cc
def test_a_fused_layer_of_several_types_keeps_each_parts_blocks() -> None:
    """q and k in Q4_K, v in Q6_K (a Q4_K_M file's attention): one QuantRows of a Q4_K and a Q6_K part, each
    into its columns (34 + 6 rows: the Q4_K part's last panel part-filled), the same bits as the chain over
    gguf's weights."""
    sizes, types = [34, 6, 6], ["Q4_K", "Q4_K", "Q6_K"]
    raws = [_blocks(t, n, 256, seed=i) for i, (t, n) in enumerate(zip(types, sizes))]
    layer = ColumnParallelLinear(256, sizes, bias=False, dtype=torch.float32, device="cpu")
    for shard, (raw, t) in enumerate(zip(raws, types)):
        layer.load_weight(GGUFBlocks(raw, t, 256), shard=shard)
    layer.finish_loading()
    assert isinstance(layer.quant, QuantRows) and layer.weight is None
    assert [(p.qtype, p.out_features) for p in layer.quant.parts] == [("Q4_K", 40), ("Q6_K", 6)]
    want_w = torch.cat([_gguf_dequant(raw, t, 256) for raw, t in zip(raws, types)])
    assert torch.equal(dequantize(layer.quant), want_w)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(3))
    want = _fma_chain(x, want_w)
    for rows in (1, 5, 20):
        assert torch.equal(layer(x[:rows]), want[:rows]), rows


def test_a_layer_given_a_type_without_a_kernel_dequantizes_it() -> None:
    """Q3_K (Q3_K_M files have it): no kernel, so the layer takes gguf's float32 weights."""
    raw = np.random.default_rng(0).integers(0, 256, (16, 110), dtype=np.uint8)  # 256 inputs: one block a row
    raw[:, 108:110] = np.array([1e-4], np.float16).view(np.uint8)  # d: finite
    layer = ColumnParallelLinear(256, [16], bias=False, dtype=torch.float32, device="cpu")
    layer.load_weight(GGUFBlocks(raw, "Q3_K", 256))
    layer.finish_loading()
    assert layer.quant is None and torch.equal(layer.weight, _gguf_dequant(raw, "Q3_K", 256))


@needs_cc
@x86_only
def test_portable_c_path_gives_the_avx2_paths_bits(tmp_path) -> None:
    """Built for plain x86-64 (no AVX2: the portable loops an ARM or older CPU compiles), the kernel gives
    the same bits as the build for this CPU: the same weights and the same FMA chain per output."""
    fn = portable_build(cpu_quant_linear.SOURCE, tmp_path).tandem_quant_linear_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, *[ctypes.c_int64] * 2,
                   ctypes.c_void_p, *[ctypes.c_int64] * 2]
    g = torch.Generator().manual_seed(4)
    for qtype in sorted(GGUF_BLOCKS):
        k = _fit(qtype, 96)
        w = pack(_blocks(qtype, 70, k, seed=5), qtype, k)
        for rows in (1, 3, 9, 20, 150):
            x = torch.randn(rows, k, generator=g)
            y = torch.empty(rows, 70)
            fn(x.data_ptr(), rows, k, k, w.data.data_ptr(), w.kind, 70, y.data_ptr(), 70, 1)
            assert torch.equal(y, quant_linear(x, w)), (qtype, rows)

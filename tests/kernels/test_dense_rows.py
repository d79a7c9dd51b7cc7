"""The float-weight kinds of the CPU linear kernel (kernels/csrc/dense_rows.h): a float32, bfloat16 or float16
weight used row-major as the checkpoint holds it. Each output is bit for bit the fixed order the header states (16
lane chains, a pairwise fold, the tail), whatever the batch, the stride, the thread count or the ISA path the
library was built for, and close to the float64 product."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tandem.kernels.native import quant_linear as cpu_quant_linear
from tandem.kernels.native.quant_linear import dense, dequantize, quant_linear
from tests.kernels.portable_build import march_build, portable_build, x86_only
from tests.kernels.test_cpu_paged_attention import needs_cc
from tests.kernels.test_quant_linear import _fma_chain

pytestmark = needs_cc
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _fixed_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, K] @ w [out, K].T in dense_rows.h's order, computed without the kernel: lane j a correctly
    rounded float32 FMA chain over k = j, j + 16, ..., the lanes folded in float32, the tail FMA'd on."""
    k = x.shape[1]
    kv = k // 16 * 16
    acc = torch.stack([_fma_chain(x[:, j:kv:16], w[:, j:kv:16]) for j in range(16)], dim=-1)
    b = acc[..., :8] + acc[..., 8:]
    c = b[..., :4] + b[..., 4:]
    s = (c[..., 0] + c[..., 2]) + (c[..., 1] + c[..., 3])
    return _fma_chain(x[:, kv:], w[:, kv:], start=s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(1, 16), (5, 48), (37, 96), (70, 200), (130, 7)])
def test_products_are_the_stated_order_bit_for_bit(dtype: torch.dtype, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3).to(dtype)
    x = torch.randn(9, k, generator=g) * 10 ** torch.randint(-3, 3, (9, k), generator=g)
    q = dense(w)
    assert (q.qtype, q.out_features, q.in_features) == (KINDS[dtype], n, k)
    assert torch.equal(dequantize(q), w.float())
    assert torch.equal(quant_linear(x, q), _fixed_order(x, w.float()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_close_to_the_float64_product_on_random_weights(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 576, generator=g).to(dtype)
    for rows in (1, 3, 8, 40, 300):
        x = torch.randn(rows, 576, generator=g)
        ref = (x.double() @ w.double().T).float()
        torch.testing.assert_close(quant_linear(x, dense(w)), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gives_the_same_bits_alone_in_any_batch_stride_and_thread_count(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    w = dense(torch.randn(203, 333, generator=g).to(dtype))
    x = torch.randn(300, 400, generator=g)[:, 5:338]  # a row stride that is not K
    whole = quant_linear(x, w, threads=2)
    for rows in (1, 2, 3, 5, 17, 300):
        for threads in (1, 2, 3):
            assert torch.equal(quant_linear(x[:rows], w, threads=threads), whole[:rows]), (rows, threads)
    assert torch.equal(quant_linear(x[7:8], w, threads=1), whole[7:8])


def test_int8_activations_leave_a_float_weight_in_float32() -> None:
    """--cpu-int8-activations quantizes activations against blocks; a float weight has none, so its product
    stays the float32 one."""
    g = torch.Generator().manual_seed(3)
    w = dense(torch.randn(48, 64, generator=g))
    x = torch.randn(4, 64, generator=g)
    assert torch.equal(quant_linear(x, w, int8=True), quant_linear(x, w))


def test_what_it_does_not_take_is_refused() -> None:
    with pytest.raises(ValueError, match="no dense CPU kernel for torch.float64"):
        dense(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-d CPU tensor"):
        dense(torch.zeros(4, 4, 4))


def _call(lib: ctypes.CDLL, x: torch.Tensor, w, threads: int = 1) -> torch.Tensor:
    fn = lib.tandem_quant_linear_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, *[ctypes.c_int64] * 2,
                   ctypes.c_void_p, *[ctypes.c_int64] * 2]
    y = torch.empty(x.shape[0], w.out_features)
    fn(x.data_ptr(), x.shape[0], w.in_features, x.stride(0), w.data.data_ptr(), w.kind, w.out_features,
       y.data_ptr(), y.stride(0), threads)
    return y


@x86_only
# the haswell build (~9 s) in the slow tier: the fast one keeps the portable build beside this CPU's own
@pytest.mark.parametrize("build", ["portable", pytest.param("haswell", marks=pytest.mark.slow)])
def test_every_isa_path_gives_the_same_bits(tmp_path, build: str) -> None:
    """The portable loops (no AVX2) and the AVX2 build give this CPU's build's bits (on an AVX-512 CPU that
    build holds the 16 lanes in one register, AVX2's in two, the portable path's in an array)."""
    src = cpu_quant_linear.SOURCE
    lib = portable_build(src, tmp_path) if build == "portable" else march_build(src, tmp_path, build)
    g = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        w = dense(torch.randn(70, 100, generator=g).to(dtype))
        for rows in (1, 3, 9, 20):
            x = torch.randn(rows, 100, generator=g)
            assert torch.equal(_call(lib, x, w), quant_linear(x, w)), (dtype, rows)


def test_bfloat16_weights_widen_exactly() -> None:
    """A bfloat16 weight is its float32 value in the product: one nonzero weight picks its x exactly."""
    w = torch.zeros(3, 32, dtype=torch.bfloat16)
    w[1, 17] = torch.tensor(np.float32(1.5)).to(torch.bfloat16)
    x = torch.arange(32, dtype=torch.float32)[None]
    assert quant_linear(x, dense(w)).tolist() == [[0.0, 25.5, 0.0]]


def _every_half(column: int) -> torch.Tensor:
    """[65536, 64] float16: row i holds the half of bit pattern i at `column`, zeros elsewhere."""
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    w = torch.zeros(halves.numel(), 64, dtype=torch.float16)
    w[:, column] = halves
    return w


def test_float16_weights_widen_exactly_subnormals_and_infinities_included() -> None:
    """A float16 weight is its float32 value in the product: each of the 65,536 halves (subnormals,
    infinities, NaN) picked out by a one-hot x."""
    for j in (0, 17, 63):
        x = torch.zeros(1, 64)
        x[0, j] = 1.0
        w = _every_half(j)
        assert torch.equal(quant_linear(x, dense(w))[0].nan_to_num(), w[:, j].float().nan_to_num()), j


@x86_only
def test_portable_build_widens_float16_as_the_native_one(tmp_path) -> None:
    """The portable bit conversion (no F16C) gives the instruction's floats."""
    lib = portable_build(cpu_quant_linear.SOURCE, tmp_path)
    w = dense(_every_half(5))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    assert torch.equal(_call(lib, x, w).nan_to_num(), quant_linear(x, w).nan_to_num())

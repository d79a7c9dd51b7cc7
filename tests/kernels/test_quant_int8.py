"""The int8-activation product (--cpu-int8-activations, kernels/csrc/quant_int8.h) for every GGUF type the
quantized kernel takes: bit for bit the plain reference of its arithmetic (kernels/reference/quant_int8.py)
on every path (AVX-512 VNNI, AVX-VNNI, AVX2's maddubs, the portable loops) and at every row count; a row's
result is the same bits alone, in any batch, at any stride and on any number of threads; the activations'
edge cases (zero, tiny, tied, non-finite) as specified; and within the error its 8-bit activations allow of
the float32 product."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tandem.kernels.native import quant_linear as cpu_quant_linear
from tandem.kernels.native.cpu_caps import cpu_caps
from tandem.kernels.native.quant_linear import GGUF_BLOCKS, QuantRows, dequantize, pack, quant_linear
from tandem.kernels.reference.quant_int8 import int8_linear_ref, quantize_activations
from tests.kernels.portable_build import march_build, portable_build, x86_only
from tests.kernels.test_cpu_paged_attention import needs_cc
from tests.kernels.test_quant_linear import _blocks, _fit

pytestmark = needs_cc
TYPES = sorted(GGUF_BLOCKS)


def _int8(x: torch.Tensor, w, threads: int | None = None) -> torch.Tensor:
    return quant_linear(x, w, threads=threads, int8=True)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 32), (37, 96), (70, 256), (21, 768)])
def test_products_equal_the_reference_bit_for_bit(qtype: str, n: int, k: int) -> None:
    """N not a multiple of 16 (the last panel part-filled), 1 to 3 K-quant super-blocks; 1-7 rows decode in
    registers (1 row: two panels a tile), 8 and more through the decoded-panel scratch, 150 two row blocks."""
    k = _fit(qtype, k)
    w = pack(_blocks(qtype, n, k, seed=n + k), qtype, k)
    g = torch.Generator().manual_seed(n)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 20, 150):
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4  # rows of several scales
        assert torch.equal(_int8(x, w), int8_linear_ref(x, w)), rows


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_gives_the_same_bits_alone_in_any_batch_and_thread_count(qtype: str) -> None:
    k, n = _fit(qtype, 96), 600  # 38 panels: the threads' ranges end mid-pair
    w = pack(_blocks(qtype, n, k, seed=9), qtype, k)
    wide = torch.randn(150, k + 32, generator=torch.Generator().manual_seed(1))
    x = wide[:, 5 : 5 + k]  # rows at a stride: read in place
    full = _int8(x, w)
    assert torch.equal(full, _int8(x.contiguous(), w))
    assert torch.equal(full, _int8(x, w, threads=1))
    for a, b in ((0, 1), (17, 18), (3, 10), (40, 47), (40, 53), (100, 150), (0, 64), (20, 150)):
        for threads in (1, 2):
            assert torch.equal(_int8(x[a:b], w, threads=threads), full[a:b]), (a, b, threads)


def _division_sensitive(amax: float, count: int) -> list[float]:
    """Inputs of a block whose maximum is amax that x / d and x * (1 / d) round to different integers."""
    f = np.float32
    d = f(amax) / f(127)
    out = []
    for k in range(-126, 126):
        mid = f((k + 0.5) * d)
        for x in (np.nextafter(mid, f(-np.inf)), mid, np.nextafter(mid, f(np.inf))):
            if np.rint(x / d) != np.rint(x * (f(1) / d)):
                out.append(float(x))
    assert len(out) >= count
    return out[:count]


def _edge_rows(k: int = 128) -> torch.Tensor:
    """Rows of 32-blocks at the format's edges (see test_activation_edge_cases_follow_the_format)."""
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(0))
    x[0, :32] = 0.0
    x[1, 32:64] = torch.linspace(-1, 1, 32) * 2e-43  # d = max / 127 is a subnormal of a few bits
    x[2, 31] = 127.0  # d = 1 exactly: the others are their own x / d
    x[2, :31] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5] + [0.25] * 22)
    x[3, 40] = float("inf")
    x[4, 100] = float("nan")
    x[6, 64:95] = torch.tensor(_division_sensitive(1.3, 31))
    x[6, 95] = 1.3
    return x


def test_activation_edge_cases_follow_the_format() -> None:
    """Per 32-block: all zeros (d = 0: q = 0, the block adds nothing), a tiny maximum (d subnormal: x / d
    clamped to 127), exact halves (x / d = k + 0.5: to even, not away from zero), inputs where x / d and
    x * (1 / d) round apart (a division), an infinite or NaN input (that row's outputs NaN, no other's)."""
    x = _edge_rows()
    qx, dx, _, _ = quantize_activations(x)
    assert dx[0, 0] == 0 and not qx[0, :32].any()
    assert dx[2, 0] == 1.0 and qx[2, :9].tolist() == [0, 2, 2, 0, -2, -2, 4, 126, -126]
    assert np.abs(qx[1, 32:64]).max() == 127
    assert np.isnan(dx[3, 1]) and np.isnan(dx[4, 3]) and not qx[3, 32:64].any()
    f = np.float32
    assert (qx[6, 64:95] == np.rint(x[6, 64:95].numpy() / (f(1.3) / f(127)))).all()
    for got, want in zip(_quantize(cpu_quant_linear._library(), x), (qx, dx, *quantize_activations(x)[2:])):
        np.testing.assert_array_equal(got, want)  # NaN where NaN
    for qtype in TYPES:
        w = pack(_blocks(qtype, 20, _fit(qtype, 128), seed=2), qtype, _fit(qtype, 128))
        xq = _edge_rows(w.in_features)
        got, want = _int8(xq, w), int8_linear_ref(xq, w)
        assert _same(got, want), qtype
        assert got[3:5].isnan().all() and not got[[0, 1, 2, 5, 6]].isnan().any(), qtype


def _quantize(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The kernel's own quantization of x (tandem_quantize_q8 of the library `lib`): q, d, s, sd."""
    m, k = x.shape
    q, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // 32, 2, dtype=torch.int32)
    d, sd = torch.empty(m, k // 32), torch.empty(m, k // 32)
    fn = lib.tandem_quantize_q8
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, *[ctypes.c_int64] * 4, *[ctypes.c_void_p] * 4]
    fn(x.data_ptr(), 0, m, k, x.stride(0), q.data_ptr(), d.data_ptr(), sd.data_ptr(), s.data_ptr())
    return q.numpy(), d.numpy(), s.numpy().astype(np.int64), sd.numpy()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("qtype", TYPES)
def test_error_is_within_what_8_bit_activations_allow(qtype: str) -> None:
    """Rounding x to its block's grid moves each input by at most d / 2, so an output moves by at most
    sum over blocks of d / 2 * sum |w| (plus float32 rounding); and on random inputs the products stay within
    a few percent of the float32 ones in norm."""
    k, n = _fit(qtype, 512), 64
    w = pack(_blocks(qtype, n, k, seed=4), qtype, k)
    wf = dequantize(w).double()
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ wf.T
    got = _int8(x, w).double()
    d = torch.from_numpy(quantize_activations(x)[1]).double()  # [16, blocks]
    bound = (d / 2) @ wf.abs().view(n, -1, 32).sum(-1).T  # [16, n]
    slack = 1e-5 * (x.double().abs() @ wf.abs().T)
    assert ((got - exact).abs() <= bound + slack).all()
    assert (got - exact).norm() / exact.norm() < 0.02


def test_a_fused_layer_of_several_types_takes_each_parts_path() -> None:
    from tests.gguf_files import k_quant_blocks

    parts = [
        pack(k_quant_blocks("Q4_K", 40, 256, 0), "Q4_K", 256),
        pack(k_quant_blocks("Q6_K", 6, 256, 1), "Q6_K", 256),
    ]
    w = QuantRows(tuple(parts))
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_int8(x, w), torch.cat([int8_linear_ref(x, p) for p in parts], 1))


def _extreme(qtype: str, n: int, k: int) -> np.ndarray:
    """Blocks whose every q is its type's largest (Q8_0: -128), the scales kept: the widest integer sums,
    where 16-bit partial sums would overflow first."""
    from tandem.benchmarks.quant_linear import _SCALES

    raw = _blocks(qtype, n, k, seed=7)
    _, elems, size = GGUF_BLOCKS[qtype]
    blocks = raw.reshape(n, k // elems, size).copy()
    keep = blocks.copy()
    blocks[:] = 0x80 if qtype == "Q8_0" else 0xFF
    for at in _SCALES[qtype]:
        blocks[..., at : at + 2] = keep[..., at : at + 2]
    return blocks.reshape(n, -1)


def _call(fn, x: torch.Tensor, w, threads: int = 2) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.out_features)
    fn(
        x.data_ptr(),
        x.shape[0],
        w.in_features,
        x.stride(0),
        w.data.data_ptr(),
        w.kind,
        w.out_features,
        y.data_ptr(),
        w.out_features,
        threads,
    )
    return y


# -march target -> the CPU flags it needs to run here: haswell is AVX2's maddubs path, alderlake AVX-VNNI
# without AVX-512 (dpbusd on 256 bits), native this CPU (AVX-512 VNNI where present).
_TARGETS = {"haswell": {"avx2", "fma", "f16c"}, "alderlake": {"avx2", "fma", "f16c", "avx_vnni"}}


@x86_only
@pytest.mark.slow  # builds every ISA variant (~20 s on 2 cores): the fast tier tests this CPU's own build
def test_every_simd_path_and_the_portable_loops_give_the_same_bits(tmp_path) -> None:
    builds = {"portable": portable_build(cpu_quant_linear.SOURCE, tmp_path)}
    flags = cpu_caps().flags
    for march, need in _TARGETS.items():
        if need <= flags:
            builds[march] = march_build(cpu_quant_linear.SOURCE, tmp_path, march)
    assert "haswell" in builds or "avx2" not in flags
    for lib in builds.values():
        lib.tandem_quant_linear_q8.restype = None
        lib.tandem_quant_linear_q8.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p,
                                               *[ctypes.c_int64] * 2, ctypes.c_void_p, *[ctypes.c_int64] * 2]
    g = torch.Generator().manual_seed(4)
    for qtype in TYPES:
        k = _fit(qtype, 128)
        w = pack(_blocks(qtype, 70, k, seed=5), qtype, k)
        for x in (*(torch.randn(rows, k, generator=g) for rows in (1, 3, 9, 20, 150)), _edge_rows(k)):
            want = _int8(x, w)
            for name, lib in builds.items():
                assert _same(_call(lib.tandem_quant_linear_q8, x, w), want), (qtype, x.shape[0], name)
        big = pack(_extreme(qtype, 20, k), qtype, k)
        x = torch.ones(24, k)
        x[1::2] = -1  # q = +-127 against every weight's largest q
        want = int8_linear_ref(x, big)
        assert torch.equal(_int8(x, big), want), qtype
        for name, lib in builds.items():
            assert torch.equal(_call(lib.tandem_quant_linear_q8, x, big), want), (qtype, name)
    x = _edge_rows()
    want = quantize_activations(x)
    # the activations themselves (a tiny block's q need not reach the output)
    for name, lib in builds.items():
        for got, ref in zip(_quantize(lib, x), want, strict=True):
            np.testing.assert_array_equal(got, ref, err_msg=name)

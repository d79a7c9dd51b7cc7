"""The C repacking of GGUF blocks (kernels/csrc/quant_repack.c): `pack` writes exactly the bytes of the numpy
`pack_reference` for every type, shape, row stride and thread count, refuses what the reference refuses
with the same message, and `dequantize_rows` gives gguf's own floats bit for bit. The blocks are random
bytes (the K-quants' 6-bit scale bytes included), so every bit of every field is exercised; only the scales
of the types gguf dequantizes as d * (q - offset) are kept finite where the test wants them packed."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native import quant_repack
from tandem.kernels.native.quant_pack import (
    GGUF_BLOCKS,
    OFFSETS,
    QuantWeight,
    dequantize,
    pack,
    pack_reference,
)
from tandem.worker.gguf_weights import GGUFBlocks
from tests.c_kernels import needs_c_kernels

pytestmark = needs_c_kernels
# numpy's warnings on the infinite and NaN scales random blocks hold on purpose (gguf's and the reference's)
_NONFINITE_OK = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")

# Byte offsets of each type's float16 d in its GGUF block (Q6_K's last; the others' first).
_D_AT = {"Q6_K": 208}


def _raw(qtype: str, n: int, k: int, seed: int = 0, finite: bool = True) -> np.ndarray:
    """Random GGUF blocks [n, bytes]; finite: the offset types' d never infinite or NaN."""
    _, elems, size = GGUF_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    if finite and qtype in OFFSETS:
        at = _D_AT.get(qtype, 0)
        d = np.ascontiguousarray(raw[..., at : at + 2]).view(np.uint16)
        d[(d & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent all ones (inf, NaN) -> a finite number
        raw[..., at : at + 2] = d.view(np.uint8).reshape(*d.shape[:-1], 2)
    return raw.reshape(n, -1)


def _set_d(raw: np.ndarray, qtype: str, row: int, block: int, half: float, field: int = 0) -> None:
    """Block `block` of row `row`: its d (field 0), or its m or dmin (field 1: the half after d)."""
    size = GGUF_BLOCKS[qtype][2]
    at = block * size + _D_AT.get(qtype, 0) + 2 * field
    raw[row, at : at + 2] = np.array([half], dtype=np.float16).view(np.uint8)


def _assert_same(a: QuantWeight, b: QuantWeight) -> None:
    assert (a.kind, a.out_features, a.in_features) == (b.kind, b.out_features, b.in_features)
    assert a.data.dtype == b.data.dtype == torch.uint8 and a.data.shape == b.data.shape
    assert a.data.is_contiguous() and torch.equal(a.data, b.data)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (signed zeros included), NaN where the other has NaN (its payload aside)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _gguf(raw: np.ndarray, qtype: str, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(-1, k))


def _k(qtype: str, blocks: int) -> int:
    return blocks * GGUF_BLOCKS[qtype][1]


def test_the_library_builds() -> None:
    assert quant_repack.available()


@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
@pytest.mark.parametrize(("n", "blocks"), [(1, 1), (16, 2), (17, 3), (45, 5), (64, 1)])
def test_c_writes_the_reference_bytes(qtype: str, n: int, blocks: int) -> None:
    """One row, whole and part-filled panels, several blocks (3 and 5 K-quant super-blocks)."""
    k = _k(qtype, blocks)
    raw = _raw(qtype, n, k, seed=n * 7 + blocks)
    _assert_same(pack(raw, qtype, k), pack_reference(raw, qtype, k))


@pytest.mark.parametrize("qtype", sorted(set(GGUF_BLOCKS) - set(OFFSETS)))
def test_scales_the_kernel_takes_as_they_are(qtype: str) -> None:
    """Infinite and NaN scales where gguf computes d * q (+ m): repacked as bytes, like any other (the
    offset types refuse them: test_infinite_or_nan_scale_refused)."""
    k = _k(qtype, 2)
    raw = _raw(qtype, 20, k, seed=1)
    for row, half in ((0, np.inf), (7, -np.inf), (19, np.nan)):
        _set_d(raw, qtype, row, 1, half)
    _assert_same(pack(raw, qtype, k), pack_reference(raw, qtype, k))


@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
def test_threads_and_row_strides(qtype: str) -> None:
    """Panels split over threads unevenly, and rows that are a slice of whole blocks of wider rows (a view,
    read in place): the same bytes as one thread over a contiguous copy."""
    k = _k(qtype, 4)
    wide = _raw(qtype, 300, k, seed=2)
    size = GGUF_BLOCKS[qtype][2]
    part = wide[:, size : 3 * size]  # blocks 1 and 2 of every row
    kind, k2 = GGUF_BLOCKS[qtype][0], _k(qtype, 2)
    one = quant_repack.repack(np.ascontiguousarray(part), kind, k2, threads=1)
    assert one is not None
    for threads in (2, 3, 7):
        assert torch.equal(quant_repack.repack(part, kind, k2, threads=threads), one)
    _assert_same(pack(part, qtype, k2), pack_reference(part, qtype, k2))


@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
@pytest.mark.parametrize("rows", [(16, 32, 5), (32, 17), (17, 16, 3), (48,), (16, 16, 16, 1)])
def test_parts_pack_as_their_concatenation(qtype: str, rows: tuple[int, ...]) -> None:
    """A fused weight's parts (q/k/v, gate/up) given apart: each whole-panel part written straight into its
    panels, a part that ends mid-panel joined first; either way the bytes of the joined rows."""
    k = _k(qtype, 2)
    parts = [_raw(qtype, n, k, seed=i + 3) for i, n in enumerate(rows)]
    whole = np.concatenate(parts)
    _assert_same(pack(parts, qtype, k), pack_reference(whole, qtype, k))
    _assert_same(pack(parts, qtype, k), pack(whole, qtype, k))


@pytest.mark.parametrize("qtype", sorted(OFFSETS))
@pytest.mark.parametrize("half", [np.inf, -np.inf, np.nan])
def test_infinite_or_nan_scale_refused(qtype: str, half: float) -> None:
    k = _k(qtype, 3)
    raw = _raw(qtype, 33, k, seed=4)
    _set_d(raw, qtype, 32, 2, half)  # the last block of the last row: in a part-filled panel
    message = f"{qtype} weight with an infinite or NaN scale: not repacked"
    for fn in (pack, pack_reference):
        with pytest.raises(ValueError) as e:
            fn(raw, qtype, k)
        assert str(e.value) == message


@pytest.mark.parametrize(
    ("qtype", "make", "k"),
    [
        ("Q2_K", lambda: np.zeros((1, 84), np.uint8), 256),
        ("Q4_0", lambda: np.zeros((2, 19), np.uint8), 32),  # a byte too many a row
        ("Q4_0", lambda: np.zeros((2, 18), np.int8), 32),
        ("Q4_0", lambda: np.zeros(18, np.uint8), 32),
        ("Q4_K", lambda: np.zeros((1, 144), np.uint8), 128),  # not whole super-blocks
        ("Q8_0", lambda: np.zeros((0, 34), np.uint8), 32),
    ],
)
def test_shapes_and_types_refused_alike(qtype: str, make, k: int) -> None:
    messages = []
    for fn in (pack, pack_reference):
        with pytest.raises(ValueError) as e:
            fn(make(), qtype, k)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_repack_checks_its_own_input() -> None:
    """The C entry reads every byte a shape claims: a wrong one is refused before it runs."""
    kind = GGUF_BLOCKS["Q4_K"][0]
    with pytest.raises(ValueError, match="expected uint8 rows of 144 bytes"):
        quant_repack.repack(np.zeros((3, 143), np.uint8), kind, 256)
    with pytest.raises(ValueError, match="expected uint8 rows of -1 bytes"):
        quant_repack.dequantize_rows(np.zeros((3, 144), np.uint8), kind, 255)
    with pytest.raises(ValueError, match="no GGUF block kind"):
        quant_repack.repack(np.zeros((3, 144), np.uint8), 8, 256)


@_NONFINITE_OK
@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
@pytest.mark.parametrize(("n", "blocks"), [(1, 1), (37, 3), (300, 8)])
def test_dequantize_rows_is_gguf_bit_for_bit(qtype: str, n: int, blocks: int) -> None:
    """Any scale (infinite and NaN included), signed zeros; one thread and several."""
    k = _k(qtype, blocks)
    raw = _raw(qtype, n, k, seed=n + blocks, finite=False)
    # random bits are rarely infinite: some of each, on d and (Q4_1, Q5_1, Q4_K, Q5_K) m or dmin
    fields = 2 if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1
    for i, (half, field) in enumerate((h, f) for h in (np.inf, -np.inf, np.nan) for f in range(fields)):
        _set_d(raw, qtype, i % n, i % blocks, half, field)
    want = _gguf(raw, qtype, k)
    for threads in (1, 3):
        got = quant_repack.dequantize_rows(raw, GGUF_BLOCKS[qtype][0], k, threads=threads)
        assert got.dtype == torch.float32 and got.shape == (n, k)
        assert _same_floats(got, want)


@_NONFINITE_OK
@pytest.mark.parametrize("qtype", sorted(GGUF_BLOCKS))
def test_blocks_dequantized_in_c_and_packed_alike(qtype: str) -> None:
    """GGUFBlocks.dequantize (an embedding table's lookup, a layer the kernel does not take) gives gguf's
    floats, a slice of whole blocks included; the packed weight's reference dequantization the same."""
    k = _k(qtype, 4)
    raw = _raw(qtype, 50, k, seed=5)
    want = _gguf(raw, qtype, k)
    assert _same_floats(GGUFBlocks(raw, qtype, k).dequantize(), want)
    size, elems = GGUF_BLOCKS[qtype][2], GGUF_BLOCKS[qtype][1]
    part = GGUFBlocks(raw, qtype, k)[10:40, elems : 3 * elems]
    assert isinstance(part, GGUFBlocks)
    assert _same_floats(part.dequantize(), _gguf(np.ascontiguousarray(raw[10:40, size : 3 * size]), qtype, 2 * elems))
    finite = ~torch.isnan(want) & ~torch.isinf(want)
    assert torch.equal(dequantize(pack(raw, qtype, k))[finite], want[finite])


def test_blocks_dequantized_into_a_table() -> None:
    """Into a float32 CPU table (an embedding's rows) in place; into another dtype through a copy; the C entry
    refuses a table it cannot write."""
    qtype, k = "Q6_K", 512
    raw = _raw(qtype, 24, k, seed=6)
    want = _gguf(raw, qtype, k)
    table = torch.full((30, k), 7.0)
    got = GGUFBlocks(raw, qtype, k).dequantize(out=table[3:27])
    assert got.data_ptr() == table[3:27].data_ptr() and _same_floats(table[3:27], want)
    assert (table[:3] == 7).all() and (table[27:] == 7).all()
    half = torch.zeros(24, k, dtype=torch.bfloat16)
    assert torch.equal(GGUFBlocks(raw, qtype, k).dequantize(out=half), want.bfloat16())
    with pytest.raises(ValueError, match="float32 CPU rows"):
        quant_repack.dequantize_rows(raw, GGUF_BLOCKS[qtype][0], k, out=torch.zeros(24, k, dtype=torch.float64))


def test_the_portable_loops_write_the_same_bytes(tmp_path: Path) -> None:
    """The library built without its SSE2 code (an ARM CPU's build): the same bytes and floats."""
    lib_path = tmp_path / "quant_repack-plain.so"
    flags = [f for f in native_build.FLAGS if f != "-march=native"]
    subprocess.run([native_build.find_compiler(), *flags, "-U__SSE2__", "-o", str(lib_path),
                    str(quant_repack.SOURCE), "-lm"], check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(lib_path))
    lib.tandem_repack.restype = ctypes.c_int64
    lib.tandem_repack.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_int64]
    lib.tandem_dequantize_rows.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_int64]
    for qtype, (kind, _, _) in sorted(GGUF_BLOCKS.items()):
        k = _k(qtype, 3)
        raw = _raw(qtype, 21, k, seed=7)
        want = pack(raw, qtype, k)
        out = torch.empty_like(want.data)
        assert lib.tandem_repack(raw.ctypes.data, 21, raw.strides[0], kind, k, out.data_ptr(), 1) == 0
        assert torch.equal(out, want.data), qtype
        y = torch.empty(21, k)
        lib.tandem_dequantize_rows(raw.ctypes.data, 21, raw.strides[0], kind, k, y.data_ptr(), k, 1)
        assert _same_floats(y, quant_repack.dequantize_rows(raw, kind, k)), qtype


@_NONFINITE_OK
def test_without_the_library_numpy_serves(monkeypatch) -> None:
    """No compiler or a failed build: pack is pack_reference, GGUFBlocks dequantize through gguf."""
    monkeypatch.setattr(quant_repack, "available", lambda: False)
    monkeypatch.setattr(quant_repack, "_library", lambda: pytest.fail("the C library used"))
    qtype, k = "Q5_K", 512
    raw = _raw(qtype, 19, k, seed=8)
    _assert_same(pack(raw, qtype, k), pack_reference(raw, qtype, k))
    assert _same_floats(GGUFBlocks(raw, qtype, k).dequantize(), _gguf(raw, qtype, k))
    bad = _raw("Q4_0", 3, 64, seed=9)
    _set_d(bad, "Q4_0", 1, 1, np.inf)
    with pytest.raises(ValueError, match="infinite or NaN scale"):
        pack(bad, "Q4_0", 64)

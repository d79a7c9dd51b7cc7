"""oneDNN's packed product equals F.linear, and a packed model computes what the plain one does; with the C
kernel a float layer keeps one weight that the kernel and torch both multiply with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cpu_linear
from tandem.kernels.cpu_linear import pack_weight, packable, packed_linear
from tandem.kernels.native import quant_linear as native_linear
from tandem.kernels.native.cpu_caps import parse_cpuinfo
from tandem.kernels.native.quant_linear import DENSE_MAX_ROWS
from tandem.worker.layers import ColumnParallelLinear, RowParallelLinear, VocabEmbedding
from tests.c_kernels import needs_c_kernels

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 19, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 64, generator=g)
    out = packed_linear(x, pack_weight(w), b)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_reads_strided_inputs_and_no_rows() -> None:
    """The MLP's down projection gets a column half of gate_up's output: a strided view."""
    w = torch.randn(16, 64)
    p = pack_weight(w)
    x = torch.randn(5, 128)[:, 32:96]
    torch.testing.assert_close(packed_linear(x, p), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert packed_linear(torch.randn(0, 64), p).shape == (0, 16)


def test_only_cpu_float32_weights_are_packed() -> None:
    assert packable(torch.randn(4, 4)) is torch.backends.mkldnn.is_available()
    assert not packable(torch.randn(4, 4, dtype=torch.bfloat16))
    assert not packable(torch.randn(4, 4, dtype=torch.float64))


def _layers(
    dtype: torch.dtype = torch.float32,
) -> tuple[ColumnParallelLinear, RowParallelLinear, VocabEmbedding]:
    torch.manual_seed(0)
    col = ColumnParallelLinear(32, [24, 24], True, dtype, "cpu")
    row = RowParallelLinear(48, 32, False, dtype, "cpu")
    head = VocabEmbedding(100, 32, dtype, "cpu")
    for p in (col.weight, col.bias, row.weight, head.weight):
        p.data.normal_()
    return col, row, head


@needs_onednn
def test_without_the_c_kernel_layers_pack_for_onednn_and_free_the_plain_weight(monkeypatch) -> None:
    monkeypatch.setattr(native_linear, "available", lambda: False)
    col, row, head = _layers()
    x, ids = torch.randn(3, 32), torch.tensor([1, 7, 99])
    before = (col(x), row(col(x)), head.logits(x), head(ids))
    col.pack_for_cpu()
    row.pack_for_cpu()
    head.pack_for_cpu(keep_weight=True)
    # the embedding still looks up
    assert col.weight is None and row.weight is None and head.weight is not None
    assert col.dense is None and head.head_dense is None
    after = (col(x), row(col(x)), head.logits(x), head(ids))
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    untied = VocabEmbedding(100, 32, torch.float32, "cpu")
    untied.pack_for_cpu(keep_weight=False)
    assert untied.weight is None and untied.head_packed is not None


@needs_c_kernels
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_float_weights_serve_the_c_kernel_and_torch_from_one_tensor(weights: torch.dtype) -> None:
    """A float32 model's layers keep one weight (cast to bf16 under bf16 weights): the C kernel multiplies
    few rows with it, torch more rows (x rounded to bf16 for a bf16 weight), both close to the float64
    product of those weights; no packed copy; the tied head's table stays float32 for the lookup."""
    col, row, head = _layers()
    col.pack_for_cpu(weights)
    row.pack_for_cpu(weights)
    head.pack_for_cpu(keep_weight=True, weight_dtype=weights)
    for layer in (col, row):
        assert layer.packed is None and layer.weight.dtype == weights
        assert layer.dense is not None and layer.dense.data.data_ptr() == layer.weight.data_ptr()
    assert head.weight.dtype == torch.float32 and head.head_dense.data.dtype == weights
    assert (head.head_dense.data.data_ptr() == head.weight.data_ptr()) == (weights == torch.float32)
    tol = {"rtol": 1e-5, "atol": 1e-4} if weights == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    for rows in (1, 3, DENSE_MAX_ROWS[col.dense.qtype], DENSE_MAX_ROWS[col.dense.qtype] + 1, 200):
        x = torch.randn(rows, 32)
        ref = x.double() @ col.weight.double().T + col.bias.double()
        torch.testing.assert_close(col(x).double(), ref, **tol)
        h = torch.randn(rows, 48)
        torch.testing.assert_close(row(h).double(), h.double() @ row.weight.double().T, **tol)
        torch.testing.assert_close(
            head.logits(x).double(), x.double() @ head.head_dense.data.double().T, **tol
        )
    untied = _layers()[2]
    untied.pack_for_cpu(keep_weight=False, weight_dtype=weights)
    assert untied.weight is None and untied.head_dense.data.dtype == weights


@needs_onednn
def test_ops_without_the_c_kernels_keep_float_layers_on_onednn(monkeypatch, tiny_model) -> None:
    """TANDEM_NO_NATIVE=1 (the worker's ops run no C kernel): a float model's float32 layers pack for oneDNN,
    bf16 weights stay plain for torch's products, and the CPU step graph does not apply."""
    from tandem.kernels.ops import resolve_ops
    from tandem.protocol.engine_config import EngineConfig
    from tandem.worker.cpu_step_graph import cpu_graph_applies
    from tandem.worker.layers.linear import PackableLinear
    from tandem.worker.loader import load_model
    from tests.kv_pool import Pool

    monkeypatch.setenv("TANDEM_NO_NATIVE", "1")
    ops = resolve_ops("cpu", torch.float32, "cpu")
    assert not ops.native
    for weights in (None, torch.bfloat16):
        model = load_model(str(tiny_model("llama")), torch.float32, "cpu", ops=ops)
        model.pack_cpu_weights(weights)
        layers = [m for m in model.modules() if isinstance(m, PackableLinear)]
        assert layers and all(m.dense is None for m in layers)
        if weights is None:
            assert all(m.packed is not None and m.weight is None for m in layers)
        else:
            assert all(m.packed is None and m.weight.dtype == torch.bfloat16 for m in layers)
        assert model.model.embed_tokens.head_dense is None
        assert not cpu_graph_applies(EngineConfig(model="unused"), model, Pool(model).kv)
        x = torch.randint(0, 100, (5,))
        assert model.model.embed_tokens(x).dtype == torch.float32


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_a_bf16_weight_takes_the_hardware_product_or_is_widened(monkeypatch, fast_bf16: bool) -> None:
    """Many rows of float32 activations against a bf16 weight (a BF16 file's, kept bf16 on any CPU): where the
    CPU multiplies bf16, x rounded to bf16 and the hardware product; elsewhere (emulated bf16 products, slower
    than float32) the weight widened exactly for the call: the float32 product of the same weights."""
    flags = "avx512f avx512_bf16" if fast_bf16 else "avx2 fma"
    monkeypatch.setattr(cpu_linear, "cpu_caps", lambda: parse_cpuinfo(f"model name\t: X\nflags\t\t: {flags}\n", 2))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 64, generator=g), torch.randn(96, 64, generator=g).bfloat16()
    y = cpu_linear.linear(x, w, None)
    want = F.linear(x.bfloat16(), w).float() if fast_bf16 else F.linear(x, w.float())
    assert y.dtype == torch.float32 and torch.equal(y, want)

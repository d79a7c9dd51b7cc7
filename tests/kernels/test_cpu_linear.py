"""oneDNN's packed product equals F.linear, and a packed model computes what the plain one does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers import ColumnParallelLinear, RowParallelLinear, VocabEmbedding
from worker.layers.cpu_linear import pack_weight, packable, packed_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


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


@needs_onednn
def test_layers_after_packing_compute_the_same_and_free_the_plain_weight() -> None:
    torch.manual_seed(0)
    col = ColumnParallelLinear(32, [24, 24], True, torch.float32, "cpu")
    row = RowParallelLinear(48, 32, False, torch.float32, "cpu")
    head = VocabEmbedding(100, 32, torch.float32, "cpu")
    for p in (col.weight, col.bias, row.weight, head.weight):
        p.data.normal_()
    x, ids = torch.randn(3, 32), torch.tensor([1, 7, 99])
    before = (col(x), row(col(x)), head.logits(x), head(ids))
    col.pack_for_cpu()
    row.pack_for_cpu()
    head.pack_for_cpu(keep_weight=True)
    assert col.weight is None and row.weight is None and head.weight is not None  # the embedding still looks up
    after = (col(x), row(col(x)), head.logits(x), head(ids))
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    untied = VocabEmbedding(100, 32, torch.float32, "cpu")
    untied.pack_for_cpu(keep_weight=False)
    assert untied.weight is None and untied.head_packed is not None

"""The CPU's transposed small-row product equals F.linear, for every row count around its thresholds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers.cpu_linear import CPU_TRANSPOSED_MAX_ROWS, cpu_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 7, CPU_TRANSPOSED_MAX_ROWS, CPU_TRANSPOSED_MAX_ROWS + 1, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_equals_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 64, generator=g)
    out = cpu_linear(x, w, b)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_cpu_linear_other_dtypes_and_shapes_take_f_linear() -> None:
    w = torch.randn(8, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(cpu_linear(x, w), F.linear(x, w))  # exact: the very same call
    x3 = torch.randn(2, 3, 4)
    assert torch.equal(cpu_linear(x3, w.float()), F.linear(x3, w.float()))
    empty = torch.randn(0, 4)
    assert cpu_linear(empty, w.float()).shape == (0, 8)


def test_cpu_linear_reads_a_strided_input() -> None:
    """qkv-style column slices reach the layers as views: the product must not assume contiguity."""
    base = torch.randn(5, 128)
    x = base[:, 32:96]
    w = torch.randn(16, 64)
    torch.testing.assert_close(cpu_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)

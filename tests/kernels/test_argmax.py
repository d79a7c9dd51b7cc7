"""The CPU argmax kernel (kernels/csrc/argmax.c) gives torch.argmax's index: first of equal maxima, the first
NaN over any number, infinities and signed zeros, rows of any stride."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.native.argmax import argmax
from tests.c_kernels import needs_c_kernels

pytestmark = needs_c_kernels

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("row", [
    [1.0, 3.0, 3.0, 2.0], [-INF, -INF, -INF], [0.0, -0.0, 0.0], [-0.0, 0.0], [1.0, NAN, 5.0, NAN],
    [NAN, 1.0], [2.0, INF, INF], [-INF, -3.0, -INF], [7.0]])
def test_edges_as_torch(row: list[float]) -> None:
    x = torch.tensor([row])
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist()


def test_random_rows_ties_and_strides_as_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-20, 20, (37, 49_155), generator=g).float() / 4  # many ties
    x[3, 100] = NAN
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    view = x[::3, 5:40_000]  # a row stride past the row
    assert torch.equal(argmax(view), view.argmax(dim=-1))


def test_what_it_does_not_take_is_refused() -> None:
    with pytest.raises(ValueError, match="float32 CPU logits"):
        argmax(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 CPU logits"):
        argmax(torch.zeros(2, 0))

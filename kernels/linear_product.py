"""A linear layer's product from whichever form of its weight the worker holds (the `linear` of
kernels/ops.py).

A layer keeps one of: a GGUF file's blocks packed for the C kernel (`quant`), a float weight the C kernel
takes for a few rows and torch multiplies with for more (`dense`: the very tensor, or the head's bf16 copy),
oneDNN's packed copy (`packed`, where the C kernels are not built), or the plain weight. Which form exists is
decided once, when the weights are packed; this picks the product for the rows at hand.
"""

from __future__ import annotations

import torch

from tandem.kernels.cpu_linear import linear
from tandem.kernels.native.quant_linear import QuantRows, QuantWeight, dense_takes, quant_linear


def linear_product(
    x: torch.Tensor,
    quant: QuantWeight | QuantRows | None,
    dense: QuantWeight | None,
    weight: torch.Tensor | None,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    int8: bool = False,
) -> torch.Tensor:
    """x [rows, in] @ W.T (+ bias) -> [rows, out]; int8: the blocks' product takes int8 activations
    (--cpu-int8-activations; a float weight has no blocks to take them against)."""
    if quant is not None:
        y = quant_linear(x, quant, int8=int8)
        return y if bias is None else y.add_(bias)
    if dense is not None:
        if dense_takes(dense, x):
            y = quant_linear(x, dense)
            return y if bias is None else y.add_(bias)
        return linear(x, dense.data, None, bias)
    return linear(x, weight, packed, bias)

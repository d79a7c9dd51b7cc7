"""A linear layer's product from whichever form of its weight the worker holds (the `linear` of
kernels/ops.py).

A layer keeps one of: a GGUF file's blocks packed for the C kernel (`quant`), a float weight the C kernel
takes for a few rows and torch multiplies with for more (`dense`: the very tensor, or the head's bf16 copy),
oneDNN's packed copy (`packed`, where the C kernels are not built), or the plain weight. Which form exists is
decided once, when the weights are packed; this picks the product for the rows at hand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.cpu_linear import linear
from tandem.kernels.native.quant_bf16 import dequantize_bf16
from tandem.kernels.native.quant_linear import QuantRows, QuantWeight, dense_takes, quant_linear


def linear_product(
    x: torch.Tensor,
    quant: QuantWeight | QuantRows | None,
    dense: QuantWeight | None,
    weight: torch.Tensor | None,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None,
    int8: bool = False,
    bf16_rows: int | None = None,
) -> torch.Tensor:
    """x [rows, in] @ W.T (+ bias) -> [rows, out]; int8: the blocks' product takes int8 activations
    (--cpu-int8-activations; a float weight has no blocks to take them against); bf16_rows: from this many
    rows the blocks are widened to bf16 for the call and x rounded to bf16, the hardware's product
    (Ops.bf16_block_rows)."""
    if quant is not None:
        if bf16_rows is not None and x.dim() == 2 and x.shape[0] >= bf16_rows:
            y = F.linear(x.to(torch.bfloat16), dequantize_bf16(quant)).to(x.dtype)
        else:
            y = quant_linear(x, quant, int8=int8)
        return y if bias is None else y.add_(bias)
    if dense is not None:
        if dense_takes(dense, x):
            y = quant_linear(x, dense)
            return y if bias is None else y.add_(bias)
        return linear(x, dense.data, None, bias)
    return linear(x, weight, packed, bias)

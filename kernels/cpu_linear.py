"""Linear products on CPU through oneDNN, with each weight packed once after loading.

torch's CPU `F.linear` in float32 goes to the BLAS (MKL), whose kernels for a few rows are poor on some
CPUs: on the 2-core AMD EPYC (AVX2) it was measured on, SmolLM2's 30 layers took 60 ms for one row (a
one-core GEMV), 100-130 ms for 2-16 rows, and jumped by up to 1.6x between neighbouring row counts
(16 rows 73 ms, 19 rows 120 ms, as `weight @ x.T`). oneDNN's inner product on a weight reordered
once into its blocked layout is smooth in the row count and faster at every size measured: 1 row 34-47 ms,
16 rows 57-73, 128 rows 1.3x under F.linear, prefill chunks of 2,048 rows even.
`python -m tandem.benchmarks.linear_shape` measures both on the machine at hand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.native.cpu_caps import cpu_caps

# From this many rows a plain float32 weight goes through oneDNN (it reorders the weight per call: slow for
# few rows).
PLAIN_ONEDNN_MIN_ROWS = 16


def packable(weight: torch.Tensor) -> bool:
    """Whether the worker packs this weight: float32 on a CPU with oneDNN (the measured case)."""
    return (
        weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> oneDNN's packed copy of it (an opaque mkldnn tensor, only for packed_linear)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [rows, in] (any strides) with pack_weight(weight)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's product: through its packed weight when it has one; a float32 CPU weight kept plain (for
    the C kernel's few rows too: worker/layers/linear.py) through oneDNN all the same (measured above MKL's
    F.linear from 16 rows, even with the packed copy from ~512); a bf16 weight under float32 activations with
    x rounded to bf16 (oneDNN's AMX product, as llama.cpp rounds them for a BF16 weight), summed in float32
    and returned in x's dtype, where the CPU multiplies bf16 (cpu_caps.fast_bf16); a float16 weight under
    float32 activations, or a bf16 one on a CPU without bf16 products (emulated there, slower than float32),
    widened (exactly) for the call, so the product is the float32 one; else F.linear."""
    if packed is not None:
        return packed_linear(x, packed, bias)
    if weight is None:
        raise RuntimeError("a linear layer without a weight (its product runs from blocks)")
    if x.dtype == torch.float32 and (weight.dtype == torch.float16
                                     or (weight.dtype == torch.bfloat16 and not cpu_caps().fast_bf16)):
        weight = weight.float()
    if weight.dtype != x.dtype:
        y = F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return y if bias is None else y.add_(bias)
    if packable(weight) and x.dim() == 2 and x.shape[0] > PLAIN_ONEDNN_MIN_ROWS:
        return packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)

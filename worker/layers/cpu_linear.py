"""`y = x @ W.T + b` laid out for the CPU BLAS when x has few rows.

For a handful of rows (a decode batch, a speculative verify step) the CPU BLAS behind torch (MKL here)
runs `F.linear(x, W)` as a GEMM whose cost grows almost linearly with the rows and whose one-row GEMV
keeps to a single core. The same product asked the other way round, `W @ x.T`, streams the weight once
for all rows over both cores: 2-3x less time for 2-32 rows on SmolLM2's layers, and one row padded to
two is faster than the GEMV. By ~128 rows the two are even and F.linear's output needs no transpose.
`python -m benchmarks.linear_shape` measures both forms on the machine at hand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row count up to which the transposed product is taken: SmolLM2's layers and head gain 1.35-1.45x at 64
# rows (the output's transpose copy included), and the layers about break even at 128.
CPU_TRANSPOSED_MAX_ROWS = 64


def cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    max_rows: int = CPU_TRANSPOSED_MAX_ROWS,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [rows, in]; on CPU in float32 with rows <= max_rows it is computed
    as weight @ x.T (one row padded to two) and returned contiguous. Elsewhere it is F.linear."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not 0 < rows <= max_rows:
        return F.linear(x, weight, bias)
    # A real copy for the pad: an expand()ed row (stride 0) sends the BLAS down a path 2x slower.
    xt = (x if rows > 1 else torch.cat((x, x))).t()
    out = torch.mm(weight, xt) if bias is None else torch.addmm(bias.unsqueeze(1), weight, xt)
    return out[:, :rows].t().contiguous()

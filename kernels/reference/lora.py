"""LoRA deltas of a batch that mixes adapters (S-LoRA/Punica's segmented product), in plain torch.

`y[rows] += (x[rows] @ a[slot].T) @ b[slot].T` for each (slot, rows) of the step: the rows of the tokens whose
request runs the adapter in that device slot. a [slots, R, in], b [slots, out, R] hold every slot's weights
(a fused layer's parts side by side in R, b block-diagonal over them; the adapter's scale folded into b).
"""
from __future__ import annotations

import torch


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 groups: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """groups: (slot, row indices; None: every row) -> y, updated in place."""
    for slot, rows in groups:
        if rows is None:
            y.add_((x @ a[slot].t()) @ b[slot].t())
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].t()) @ b[slot].t())
    return y

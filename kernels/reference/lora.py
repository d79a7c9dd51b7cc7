"""LoRA deltas of a batch that mixes adapters (S-LoRA/Punica's segmented product), in plain torch.

`y[rows] += (x[rows] @ a[slot].T) @ b[slot]` for each adapter slot of the step: the rows of the tokens whose
request runs the adapter in that device slot. a [slots, R, in], b [slots, R, out] hold every slot's weights
(PEFT's lora_A and lora_B transposed; a fused layer's parts side by side in R, b block-diagonal over them;
the adapter's scale folded into b).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraRows:
    """A step's token rows by adapter: slot_of_row [T] int64 (-1: the base), the C and Triton kernels';
    groups, torch's: (slot, its rows; None: every row). No groups: a recorded graph's rows, whose slots only
    the device knows (the torch twin then runs every slot's product on every row, keeping each row's own)."""

    slot_of_row: torch.Tensor
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoraRows,
                 cols: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """y, updated in place. cols [parts + 1]: the parts' column bounds in y; ranks [slots]: the rows of each
    part a slot's adapter fills (the kernels read only those rows and the blocks of b the bounds give; the
    products here take the zeros around them)."""
    if not rows.groups:
        slot_of = rows.slot_of_row
        t = slot_of.numel()
        for slot in range(a.shape[0]):
            keep = (slot_of == slot).unsqueeze(1).to(y.dtype)
            y[:t].add_(((x[:t] @ a[slot].t()) @ b[slot]) * keep)
        return y
    for slot, idx in rows.groups:
        if idx is None:
            y.add_((x @ a[slot].t()) @ b[slot])
        else:
            y.index_add_(0, idx, (x.index_select(0, idx) @ a[slot].t()) @ b[slot])
    return y

"""Device slots for LoRA adapters in a model's linear layers, and the step's map of token rows to slots.

Every layer an adapter may target (the attention's q/k/v and o, the MLP's gate/up and down) holds `LoraSlots`:
a [slots, parts * max_rank, in] and b [slots, parts * max_rank, out] with one adapter per slot (a fused
layer's parts side by side, b block-diagonal over them, the adapter's scale folded into b; an empty part, or
slot, is zeros). Its product adds each token's adapter's delta (Ops.lora_add) when the step runs adapters: the
model runner sets the shared `LoraContext` for such a step and clears it after, so a step of the base alone
is the base's product, untouched. Tensor parallelism splits the slots as the layer: a column-parallel layer's
b by its rank's output rows, a row-parallel layer's a by its input columns (its partial delta is summed by
the layer's all-reduce: x_r A_r^T B^T summed over ranks is x A^T B^T).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LoraContext:
    # the step's token rows by adapter (kernels/reference/lora.py's LoraRows); None: it runs no adapter
    groups: Any = None


@dataclass
class LoraSlots:
    a: torch.Tensor
    b: torch.Tensor
    ctx: LoraContext
    parts: list[tuple[int, int]] = field(default_factory=list)  # (offset, width) of each part in y's columns
    max_rank: int = 0
    cols: torch.Tensor | None = None  # int64 [parts + 1]: the parts' column bounds (the C kernel's)
    ranks: torch.Tensor | None = None  # int64 [slots]: each part's rows the slot's adapter fills (0: none)


# a checkpoint's projection -> (this engine's layer, its part: the fused layers' as the models stack them)
LAYER_OF = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
_TARGETABLE = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The model's layers an adapter may target, by module path (the decoder's: not an encoder's, not an
    MoE layer's experts)."""
    from tandem.worker.layers.linear import PackableLinear

    return {name: m for name, m in model.named_modules()
            if isinstance(m, PackableLinear) and _TARGETABLE.match(name)}


def lora_context(model: torch.nn.Module) -> LoraContext | None:
    """The context the model's target layers share; None: the model takes no adapters."""
    return next((m.lora.ctx for m in lora_layers(model).values() if m.lora is not None), None)


def install_slots(model: torch.nn.Module, slots: int, max_rank: int, dtype: torch.dtype, device: Any,
                  ) -> LoraContext:
    """Give every targetable layer `slots` empty adapter slots; the context the runner sets per step."""
    ctx = LoraContext()
    for layer in lora_layers(model).values():
        parts = [(o, n) for o, n in zip(layer.shard_offsets, layer.shard_sizes, strict=True)] \
            if hasattr(layer, "shard_offsets") else [(0, layer.out_features)]
        r = len(parts) * max_rank
        cols = torch.tensor([o for o, _ in parts] + [parts[-1][0] + parts[-1][1]], dtype=torch.int64)
        layer.lora = LoraSlots(torch.zeros(slots, r, layer.in_features, dtype=dtype, device=device),
                               torch.zeros(slots, r, layer.out_features, dtype=dtype, device=device), ctx,
                               parts, max_rank, cols.to(device),
                               torch.zeros(slots, dtype=torch.int64, device=device))
    return ctx

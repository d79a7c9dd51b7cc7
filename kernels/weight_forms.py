"""Which form each weight takes for the worker's kernels (the `weights` of kernels/ops.py), decided once
while the weights are loaded and packed: a GGUF file's blocks in the C kernel's layout, a float weight the C
kernel takes for a few rows (torch multiplies with the same tensor for more), oneDNN's packed copy where
the C kernels do not run, an MoE layer's experts and router in the C kernel's panels. The layers hold
whatever this gives them; kernels/linear_product.py multiplies with it. No layer imports the kernels'
modules or tests a device for this."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kernels.cpu_linear import pack_weight, packable
from tandem.kernels.native import moe as native_moe
from tandem.kernels.native import quant_linear
from tandem.kernels.native.moe import ExpertWeights
from tandem.kernels.native.quant_pack import QuantRows, QuantWeight, dense, pack

__all__ = ["ExpertWeights", "QuantRows", "QuantWeight", "WeightForms", "weight_forms"]


@dataclass(frozen=True)
class WeightForms:
    native: bool  # the C kernels run (CPU, float32 activations, built, not TANDEM_NO_NATIVE)
    native_moe: bool  # and an MoE layer runs as one call of kernels/native/moe.py

    @staticmethod
    def takes_float(w: torch.Tensor | None, weight_dtype: torch.dtype | None = None) -> bool:
        """A float32 weight on CPU, or one loaded in weight_dtype already (worker/loader.py): the only kinds
        these forms replace (elsewhere torch takes the weight)."""
        return w is not None and w.device.type == "cpu" and w.dtype in (torch.float32, weight_dtype)

    @staticmethod
    def blocks(raw: np.ndarray | Sequence[np.ndarray], qtype: str, in_features: int) -> QuantWeight:
        """A GGUF file's blocks [rows, bytes] (or parts of one weight, rows after rows) in the C kernel's
        layout; ValueError for a type or scale the kernel does not take (the caller dequantizes instead)."""
        return pack(raw, qtype, in_features)

    def float_weight(
        self, w: torch.Tensor, weight_dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor | None, QuantWeight | None, torch.Tensor | None]:
        """(weight, dense, packed) of a linear layer's float32 CPU weight: cast to weight_dtype (bf16 weights
        under float32 activations, worker/device.py), kept for the C kernel's few rows and torch's many
        (`dense` holds the same tensor); without the C kernels, oneDNN's packed copy instead of the weight
        where it takes it."""
        if weight_dtype == torch.float16 and not self.native:
            weight_dtype = None  # only the C kernel reads halves at float32's speed: torch keeps float32
        if weight_dtype is not None and weight_dtype != w.dtype:
            w = w.to(weight_dtype)
        if self.native:
            return w, dense(w), None
        if packable(w):
            return None, None, pack_weight(w)
        return w, None, None

    def head_weight(
        self, w: torch.Tensor, weight_dtype: torch.dtype | None = None
    ) -> tuple[QuantWeight | None, torch.Tensor | None]:
        """(dense, packed) of an LM head's float32 CPU table: the C kernel's form in weight_dtype (the table
        itself, or its copy when the table is also the embedding's), or oneDNN's packed copy without the C
        kernels; (None, None): the table as it is."""
        if self.native:
            return dense(w if weight_dtype in (None, w.dtype) else w.to(weight_dtype)), None
        return (None, pack_weight(w)) if packable(w) else (None, None)

    def experts(self, w: torch.Tensor | list[QuantWeight]) -> ExpertWeights | None:
        """An MoE layer's [E, rows, inputs] float experts, or each expert's packed blocks, in the C kernel's
        layout; None where the layer does not run natively."""
        return native_moe.pack_experts(w) if self.native_moe else None

    def router(self, w: torch.Tensor) -> torch.Tensor | None:
        return native_moe.pack_router(w) if self.native_moe else None


def weight_forms(native: bool) -> WeightForms:
    return WeightForms(native, native and native_moe.available())


def standalone_forms() -> WeightForms:
    """For a layer made without the worker's Ops (tests, tools): the C kernels where they are built."""
    return weight_forms(quant_linear.available())

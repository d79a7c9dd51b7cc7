"""Vocab-parallel token embedding and LM head: rank r holds rows [r*shard, (r+1)*shard) of the vocab."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.kernels.linear_product import linear_product
from tandem.kernels.weight_forms import QuantWeight, standalone_forms
from tandem.worker.gguf_weights import GGUFBlocks

if TYPE_CHECKING:
    from tandem.kernels.ops import Ops


class VocabEmbedding(nn.Module):
    """Also the LM head (same [vocab, hidden] layout): `logits` gives every rank the full-vocab logits."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
        tp_rank: int = 0, tp_size: int = 1, ops: Ops | None = None,
    ) -> None:
        super().__init__()
        # the head's product from blocks takes int8 activations (the worker's Ops: --cpu-int8-activations)
        self.ops = ops  # the worker's: its `linear` runs the head's product (None: made alone)
        self.int8_activations = ops is not None and ops.int8_activations
        self.forms = standalone_forms() if ops is None else ops.weights  # as PackableLinear's
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        # Rounded up: the last rank's rows past the vocab are zero padding, cut from the logits.
        self.shard = -(-vocab_size // tp_size)
        self.start = tp_rank * self.shard
        self.end = min(vocab_size, self.start + self.shard)
        self.weight = nn.Parameter(
            torch.zeros(self.shard, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    head_packed: torch.Tensor | None = None
    # The LM head from a GGUF file's blocks (kernels/native/quant_linear.py); the lookup keeps the float rows.
    head_quant: QuantWeight | None = None
    # A float32 model's head as a float weight for the C kernel's few rows (the table itself, or its bf16
    # copy under bf16 weights); torch multiplies with the same tensor for more rows.
    head_dense: QuantWeight | None = None
    _head_blocks: GGUFBlocks | None = None

    def pack_for_cpu(self, keep_weight: bool, weight_dtype: torch.dtype | None = None) -> None:
        """The LM head of a float32 model on CPU, unless it runs from quantized blocks: its weight for the
        C kernel (`head_dense`; in weight_dtype, a copy when the table is also the embedding, keep_weight),
        or, without the C kernels, oneDNN's packed copy (cpu_linear.py). Without keep_weight (a head that
        is not also the embedding) the float32 table is then freed."""
        w = self.weight
        if self.head_quant is not None or not self.forms.takes_float(w):
            if not keep_weight and self.head_quant is not None:
                self.weight = None
            return
        self.head_dense, self.head_packed = self.forms.head_weight(w.data, weight_dtype)
        if not keep_weight and (self.head_dense is not None or self.head_packed is not None):
            self.weight = None

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        n = self.end - self.start
        if n > 0:
            part = tensor[self.start : self.end]
            if isinstance(part, GGUFBlocks):
                self._head_blocks = part
                part.dequantize(out=self.weight.data[:n])  # in place: no second table
            else:
                self.weight.data[:n].copy_(part)

    def finish_loading(self, head: bool) -> None:
        """As the LM head (`head`), its product from the blocks it was loaded from, when the kernel takes
        them; an embedding that is not the head drops its blocks."""
        blocks, self._head_blocks = self._head_blocks, None
        if blocks is not None and head:
            try:
                self.head_quant = self.forms.blocks(blocks.raw, blocks.qtype, blocks.in_features)
            except ValueError:
                pass  # a scale the repacking cannot hold: the float weight serves

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        # Ids outside this rank's rows look up row 0 and are zeroed; the all-reduce fills them in.
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill_(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out)
        return out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] -> float32 logits [N, vocab], the same on every rank."""
        run = linear_product if self.ops is None else self.ops.linear
        local = run(h, self.head_quant, self.head_dense, self.weight, self.head_packed, None)
        if local.dtype != torch.float32:
            local = local.float()
        if local.shape[1] < self.shard:  # the last rank's padding rows past the vocab (blocks): zero logits
            local = torch.cat([local, local.new_zeros(local.shape[0], self.shard - local.shape[1])], dim=1)
        if self.tp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

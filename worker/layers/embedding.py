"""Vocab-parallel token embedding and LM head: rank r holds rows [r*shard, (r+1)*shard) of the vocab."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.layers.cpu_linear import linear, pack_weight, packable


class VocabEmbedding(nn.Module):
    """Also the LM head (same [vocab, hidden] layout): `logits` gives every rank the full-vocab logits."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
        tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        # Rounded up: the last rank's rows past the vocab are zero padding, cut from the logits.
        self.shard = -(-vocab_size // tp_size)
        self.start = tp_rank * self.shard
        self.end = min(vocab_size, self.start + self.shard)
        self.weight = nn.Parameter(
            torch.zeros(self.shard, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    head_packed: torch.Tensor | None = None

    def pack_for_cpu(self, keep_weight: bool) -> None:
        """The LM head's product through oneDNN (cpu_linear.py) on a packed copy of the weight; without
        keep_weight (a head that is not also the embedding) the plain weight is freed."""
        if self.weight is not None and packable(self.weight):
            self.head_packed = pack_weight(self.weight)
            if not keep_weight:
                self.weight = None

    def load_weight(self, tensor: Any, shard: int = 0, param: str = "weight") -> None:
        n = self.end - self.start
        if n > 0:
            self.weight.data[:n].copy_(tensor[self.start : self.end])

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
        local = linear(h, self.weight, self.head_packed).float()
        if self.tp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

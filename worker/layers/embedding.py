"""Token embedding (replicated on every rank for now; vocab-parallel sharding can come later)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def load_weight(self, tensor: torch.Tensor, shard: int = 0, param: str = "weight") -> None:
        self.weight.data.copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

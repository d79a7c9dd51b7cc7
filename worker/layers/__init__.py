"""Building blocks of the decoder models (tensor-parallel: each rank holds its shard)."""

from worker.layers.embedding import VocabEmbedding
from worker.layers.linear import (
    ColumnParallelLinear,
    PackableLinear,
    QKVParallelLinear,
    RowParallelLinear,
    local_heads,
)
from worker.layers.norm import GemmaRMSNorm, RMSNorm
from worker.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "GemmaRMSNorm",
    "PackableLinear",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabEmbedding",
    "local_heads",
]

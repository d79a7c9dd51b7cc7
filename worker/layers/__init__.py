"""Building blocks of the decoder models (tensor-parallel: each rank holds its shard)."""

from tandem.worker.layers.embedding import VocabEmbedding
from tandem.worker.layers.linear import (
    ColumnParallelLinear,
    PackableLinear,
    QKVParallelLinear,
    RowParallelLinear,
    local_heads,
)
from tandem.worker.layers.norm import GemmaRMSNorm, RMSNorm
from tandem.worker.layers.rotary import RotaryEmbedding

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

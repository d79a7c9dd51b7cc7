"""Building blocks of the decoder models (tensor-parallel-shaped, only tp_size=1 exercised so far)."""

from worker.layers.embedding import VocabEmbedding
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding, apply_rotary

__all__ = [
    "ColumnParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabEmbedding",
    "apply_rotary",
]

"""What an embedding request asks for besides its input: the vector's length and whether it is normalized.
Bounds are `msgspec.Meta` constraints, so a bad value fails at decode time in the frontend, named."""
from __future__ import annotations

from typing import Annotated

import msgspec


class EmbedParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    # Keep the first `dimensions` values (a Matryoshka model's nested embeddings), then normalize.
    # None: the model's hidden size.
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    normalize: bool = True  # L2: unit length, so a dot product is the cosine similarity

"""User-facing sampling parameters (vLLM field names).

Bounds are `msgspec.Meta` constraints, so a bad value fails at decode time with the field named,
in whatever process decodes it first (the frontend).
"""
from __future__ import annotations

from typing import Annotated

import msgspec

NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Prob = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]

MAX_STOP_TOKEN_IDS = 64


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    # None: as many as fit in the context after the prompt.
    max_tokens: PosInt | None = None
    temperature: NonNegFloat = 1.0
    top_p: Prob = 1.0
    # -1 disables top-k; 0 is rejected in validate() (vLLM treats it as a mistake).
    top_k: TopK = -1
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    seed: Seed | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Cross-field checks msgspec.Meta cannot express. Raises ValueError naming the field."""
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

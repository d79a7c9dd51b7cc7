"""User-facing sampling parameters (vLLM field names).

Bounds are `msgspec.Meta` constraints, so a bad value fails at decode time with the field named,
in whatever process decodes it first (the frontend).
"""
from __future__ import annotations

from typing import Annotated, Any

import msgspec

NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Prob = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]

MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
NumLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
# Below this temperature sampling is greedy: dividing logits by ~0 would overflow to inf/nan.
GREEDY_BELOW_TEMPERATURE = 1e-5


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
    # Stop strings end the request when they appear in the text, across token boundaries; they are
    # trimmed from the output unless include_stop_str_in_output.
    stop: Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # EOS and stop tokens are suppressed until this many tokens were generated.
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Top-N logprobs with each sampled token / each prompt token (None: not computed).
    logprobs: NumLogprobs | None = None
    prompt_logprobs: NumLogprobs | None = None
    # Prompt logprobs are reported for prompt tokens at this index and after; the prefix cache may serve
    # the tokens before it (0: every prompt token is computed, as vLLM does; SGLang's logprob_start_len).
    logprob_start_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    skip_special_tokens: bool = True
    # Structured output (at most one): a JSON schema (a document, or a dict such as a Pydantic model's
    # model_json_schema()), any JSON, a regular expression, an EBNF grammar, or one of fixed strings.
    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None

    def validate(self) -> None:
        """Cross-field checks msgspec.Meta cannot express. Raises ValueError naming the field."""
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        constraints = [self.json_schema is not None, self.json_object, self.regex is not None,
                       self.grammar is not None, self.choice is not None]
        if sum(constraints) > 1:
            raise ValueError("give at most one of json_schema, json_object, regex, grammar, choice")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

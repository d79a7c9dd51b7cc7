"""Request bodies of the OpenAI API (pydantic), plus tandem's own sampling fields as extras.

Unknown fields are rejected (400 naming the field) rather than silently ignored, except where they
ask for nothing: null, or an SGLang extension at its default (sglang-router spells those out when it
forwards a request).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.protocol.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from tandem.protocol.session_messages import MAX_SESSION_TIMEOUT_S, MAX_SESSION_TOKENS

# SGLang's extensions at their defaults: sent by sglang-router, meaning "not asked for".
_UNASKED = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
            "separate_reasoning": True, "stream_reasoning": True, "continue_final_message": False}
# No vocabulary is larger than 2**31; the OpenAPI document says the served model's own bound (openapi.py reads
# the mark), which the engine enforces.
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1, json_schema_extra={"x-token-id": True})]


def _document_extras(schema: dict[str, Any], cls: type[Body]) -> None:
    """The document says what is taken: other keys only as null, and the SGLang extensions at their
    defaults."""
    schema["additionalProperties"] = {"type": "null"}
    for k, v in cls.unasked.items():
        schema.setdefault("properties", {})[k] = {"const": v}


class Body(BaseModel):
    # strict: a number given as a string (or a bool as a number) is refused, as OpenAI's own server does.
    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, strict=True, json_schema_extra=_document_extras
    )
    unasked: ClassVar[dict[str, Any]] = {}  # keys dropped when they hold these values

    @model_validator(mode="before")
    @classmethod
    def _drop_unasked(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {k: v for k, v in data.items()
                if k in known or not (v is None or (k in cls.unasked and v == cls.unasked[k]))}


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Body):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SessionParamsBody(Body):
    """Continue a session (POST /open_session): from its turn `rid` (a response id), default the latest."""

    id: str
    rid: str | None = None


class SamplingBody(Body):
    """Fields both completions and chat completions take (bounds as SamplingParams')."""

    unasked: ClassVar[dict[str, Any]] = _UNASKED

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    response_format: ResponseFormat | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # tandem's own (vLLM's names), sent by the openai client as extra_body.
    top_k: Annotated[int, Field(ge=-1)] = -1  # 0 is refused too (SamplingParams.validate)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    # lower first (--scheduling-policy priority)
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0
    session_params: SessionParamsBody | None = None


class CompletionRequest(SamplingBody):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageURL(Body):
    url: str  # data:image/...;base64,..., or http(s)/file where the operator allows (image_sources.py)
    detail: Literal["auto", "low", "high"] | None = None  # the model's processor decides the size


class ImageURLPart(Body):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageBody(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning, for templates that show it


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingBody):
    messages: Annotated[list[ChatMessageBody], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the template, e.g. enable_thinking


class OpenSessionRequest(Body):
    capacity_tokens: Annotated[int, Field(ge=1, le=MAX_SESSION_TOKENS)]
    # idle seconds; default: the client's
    timeout: Annotated[float, Field(gt=0, le=MAX_SESSION_TIMEOUT_S)] | None = None


class CloseSessionRequest(Body):
    session_id: str


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]

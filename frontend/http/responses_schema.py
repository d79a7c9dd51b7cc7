"""Request bodies of OpenAI's Responses API (pydantic), as strict as the chat ones: unknown fields are a 400.

Input items are a message (its `type` may be left out), a function call the model made, a function call's
output, or a reasoning item (taken, and left out of the prompt: templates drop earlier turns' thinking).
The fields a response's own output items carry are accepted, so `input=previous.output + [...]` works.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from tandem.frontend.http.schemas import Body, FunctionDef

_STATUS = Literal["in_progress", "completed", "incomplete"]


class InputText(Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text part sent back
    logprobs: list[Any] | None = None


class InputImage(Body):
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URL, or http(s)/file where the operator allows
    file_id: str | None = None  # refused: this server keeps no files
    detail: Literal["auto", "low", "high"] | None = None


MessagePart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[MessagePart]
    id: str | None = None
    status: _STATUS | None = None


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: _STATUS | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: _STATUS | None = None


class ReasoningItem(Body):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: _STATUS | None = None


def _item_type(v: Any) -> str:
    return (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDef):
    type: Literal["function"]


class NamedFunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # taken; a local model has no such dial


class ReasoningConfig(Body):
    """Taken so agents that always send it work; whether a model thinks is its template's business
    (`chat_template_kwargs`, e.g. {"enable_thinking": false})."""
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Body):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None  # nothing extra is held back, so nothing extra to include
    truncation: Literal["disabled"] | None = None  # a prompt past the context is an error, never cut
    prompt_cache_key: str | None = None  # the prefix cache finds shared prefixes by itself
    # tandem's own, as in chat completions (extra_body in the openai client).
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # lower first (--scheduling-policy priority)
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0

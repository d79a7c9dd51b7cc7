"""Request bodies of Anthropic's Messages API (pydantic); unknown fields are a 400 in Anthropic's shape.

Content blocks: text, tool_use, tool_result, and thinking (taken back and handed to the template as the
turn's reasoning). `cache_control` is taken everywhere it may stand and means nothing here: the prefix cache
keeps what repeats by itself. Images and server tools are not served (a 400 naming the block).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from tandem.frontend.http.schemas import Body

CacheControl = dict[str, Any] | None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl = None


class ImageSource(Body):
    type: Literal["base64", "url"]
    media_type: str | None = None  # image/jpeg, image/png, image/gif, image/webp (Pillow reads the bytes)
    data: str | None = None  # base64
    url: str | None = None


class ImageBlock(Body):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl = None

    @property
    def url(self) -> str:
        """As an OpenAI image_url: base64 data as a data: URL."""
        s = self.source
        if s.type == "url":
            return s.url or ""
        return f"data:{s.media_type or 'image/png'};base64,{s.data or ''}"


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


def _block_type(v: Any) -> str | None:
    return v.get("type") if isinstance(v, dict) else getattr(v, "type", None)


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Body):
    """Whether the model thinks, for templates that have the switch (enable_thinking; "adaptive" leaves
    the template's default). The budget is not enforced: max_tokens bounds the whole reply."""
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    """Structured output (`format`) through the engine's grammar; `effort` is taken and means nothing here."""
    effort: str | None = None
    format: JsonOutputFormat | None = None


class Metadata(Body):
    user_id: str | None = None


class CountTokensRequest(Body):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    chat_template_kwargs: dict[str, Any] | None = None  # tandem's own, as in chat completions


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here

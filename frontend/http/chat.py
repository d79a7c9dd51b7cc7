"""Chat: messages (and tools) through the model's chat template, and the way tool calls come out.

With `tool_choice` "auto" the model writes calls in its own (Hermes/Qwen) format; "required" or a named
function constrains the output with a JSON schema instead (the grammar path), and the whole output is
then the call(s). `tool_calls.py` reads them out of the text either way. The three APIs (chat completions,
Responses, Anthropic's Messages) each say this in their own words: `ToolSetup` is what they mean.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tandem.frontend import prompt_tokens
from tandem.frontend.http.errors import APIError
from tandem.frontend.http.schemas import (
    ChatCompletionRequest,
    ChatMessageBody,
    FunctionDef,
    ImageURLPart,
    NamedToolChoice,
    TextPart,
)
from tandem.frontend.http.tool_calls import ToolCallParser
from tandem.protocol.errors import InvalidRequestError


def _text(m: ChatMessageBody) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(p.text for p in m.content if isinstance(p, TextPart))


def image_urls(messages: list[ChatMessageBody]) -> list[str]:
    """The messages' image URLs, in order."""
    return [p.image_url.url for m in messages if isinstance(m.content, list)
            for p in m.content if isinstance(p, ImageURLPart)]


def template_message(m: ChatMessageBody, with_images: bool = False) -> dict[str, Any]:
    """A message as chat templates read it; with_images: content parts, each image `{"type": "image"}`
    (the images go to the model's processor beside the messages, in the same order)."""
    content: Any = _text(m)
    if with_images and isinstance(m.content, list):
        content = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                   for p in m.content]
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    if m.tool_calls:
        d["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _loads_or_str(c.function.arguments)}}
            for c in m.tool_calls
        ]
    return d


def _loads_or_str(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return s


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[ChatMessageBody],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids for an HTTP body's messages: prompt_tokens.render_chat (the frontend's one chat
    rendering) over the messages as the template reads them, its error in the HTTP API's shape."""
    try:
        return prompt_tokens.render_chat(tokenizer, [template_message(m) for m in messages], tools,
                                         add_generation_prompt, template_kwargs)
    except InvalidRequestError as e:
        raise APIError(400, e.message, "messages", "invalid_messages") from e


@dataclass(frozen=True)
class ToolSetup:
    """The functions a request offers and how the model may use them: `choice` "named" forces `named`."""
    functions: list[FunctionDef]
    choice: Literal["none", "auto", "required", "named"] = "auto"
    named: str | None = None
    parallel: bool = True
    param: str = "tool_choice"  # the field errors name

    def template_tools(self) -> list[dict] | None:
        """The tools the model may call, for the chat template (None when none, or choice "none")."""
        if not self.functions or self.choice == "none":
            if self.choice in ("required", "named"):
                raise APIError(400, f"{self.param} {self.choice!r} needs tools", self.param)
            return None
        return [f.model_dump(exclude_none=True) for f in self.functions]

    def forced_schema(self) -> dict | None:
        """The JSON schema that forces a tool call (choice "required" or a named function), else None."""
        if not self.functions or self.choice in ("auto", "none"):
            return None
        if self.choice == "named":
            fn = next((f for f in self.functions if f.name == self.named), None)
            if fn is None:
                raise APIError(400, f"{self.param} names {self.named!r}, which is not in tools", self.param)
            return fn.parameters
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [f.name]}, "arguments": f.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
        return {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                **({} if self.parallel else {"maxItems": 1})}

    def parser(self) -> ToolCallParser | None:
        """The parser for a reply's tool calls (None when no tools are active)."""
        if self.template_tools() is None:
            return None
        if self.choice == "named":
            return ToolCallParser("named", self.named)
        return ToolCallParser("required" if self.choice == "required" else "auto")


def chat_tools(req: ChatCompletionRequest) -> ToolSetup:
    tc = req.tool_choice
    if isinstance(tc, NamedToolChoice):
        return ToolSetup(
            [t.function for t in req.tools or []], "named", tc.function.name, req.parallel_tool_calls
        )
    return ToolSetup([t.function for t in req.tools or []], tc or "auto", None, req.parallel_tool_calls)

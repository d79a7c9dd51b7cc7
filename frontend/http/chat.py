"""Chat: messages (and tools) through the model's chat template, and the way tool calls come out.

With `tool_choice` "auto" the model writes calls in its own (Hermes/Qwen) format; "required" or a named
function constrains the output with a JSON schema instead (the grammar path), and the whole output is
then the call(s). `tool_calls.py` reads them out of the text either way.
"""
from __future__ import annotations

import json
from typing import Any

from frontend import prompt_tokens
from frontend.http.errors import APIError
from frontend.http.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice
from frontend.http.tool_calls import ToolCallParser
from protocol.errors import InvalidRequestError


def _text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    return "".join(p.text for p in m.content)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m)}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
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


def render_chat(tokenizer: Any, messages: list[ChatMessage], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the conversation, through the frontend process's own chat rendering."""
    try:
        return prompt_tokens.render_chat(tokenizer, [_template_message(m) for m in messages], tools,
                                         add_generation_prompt)
    except InvalidRequestError as e:
        raise APIError(400, e.message, "messages", "invalid_messages") from e


def active_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools the model may call (None when none are given or tool_choice is "none")."""
    if not req.tools or req.tool_choice == "none":
        if isinstance(req.tool_choice, NamedToolChoice) or req.tool_choice == "required":
            raise APIError(400, f"tool_choice {req.tool_choice!r} needs tools", "tool_choice")
        return None
    return [t.function.model_dump(exclude_none=True) for t in req.tools]


def forced_schema(req: ChatCompletionRequest) -> dict | None:
    """The JSON schema that forces a tool call (tool_choice "required" or a named function), else None."""
    if not req.tools or req.tool_choice in (None, "auto", "none"):
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        fn = next((t.function for t in req.tools if t.function.name == req.tool_choice.function.name), None)
        if fn is None:
            raise APIError(400, f"tool_choice names {req.tool_choice.function.name!r}, which is not in tools",
                           "tool_choice")
        return fn.parameters
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]}, "arguments": t.function.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in req.tools]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
            **({} if req.parallel_tool_calls else {"maxItems": 1})}


def tool_call_parser(req: ChatCompletionRequest) -> ToolCallParser | None:
    """The parser for a choice's tool calls (None when no tools are active)."""
    if active_tools(req) is None:
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        return ToolCallParser("named", req.tool_choice.function.name)
    return ToolCallParser("required" if req.tool_choice == "required" else "auto")

"""One reply's text into reasoning, content and tool calls as it streams, for every chat-shaped API.

The reasoning parser (when the server has one) takes the text first; what it leaves as content goes
through the tool-call parser (when tools are active), so calls are only ever read from the content.
Fed whole or in any pieces, the parts add up the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.http.tool_calls import ParsedToolCall, ToolCallParser
from tandem.frontend.reasoning_parser import ReasoningParser
from tandem.protocol.final_info import FinalInfo


@dataclass
class ReplyDelta:
    """What one piece of the reply adds; `tool_calls` in OpenAI's streaming shape (tool_calls.py)."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ReplyParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning_parser, self.tools = reasoning, tools
        self._content = ""  # without a tool parser
        self.final: FinalInfo | None = None

    def add(self, d: CompletionDelta) -> ReplyDelta:
        out = ReplyDelta()
        text = d.text
        if self.reasoning_parser is not None:
            r = self.reasoning_parser.feed(text)
            if d.finished:
                rest = self.reasoning_parser.finish()
                r.reasoning, r.content = r.reasoning + rest.reasoning, r.content + rest.content
            out.reasoning, text = r.reasoning, r.content
        if self.tools is None:
            out.content = text
            self._content += text
        else:
            parsed = self.tools.feed(text)
            out.content, out.tool_calls = parsed.content, parsed.tool_calls
            if d.finished:
                rest = self.tools.finish()
                out.content += rest.content
                out.tool_calls += rest.tool_calls
        if d.finished:
            self.final = d.final
        return out

    @property
    def reasoning(self) -> str | None:
        return self.reasoning_parser.reasoning or None if self.reasoning_parser is not None else None

    @property
    def content(self) -> str:
        return self.tools.content if self.tools is not None else self._content

    @property
    def calls(self) -> list[ParsedToolCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's: "length" when cut off (a call cut off too), "tool_calls" when it called, else "stop"."""
        if self.final is None:
            return None
        if self.final.finish_reason == "length":
            return "length"
        return "tool_calls" if self.calls else "stop"

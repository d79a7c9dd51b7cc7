"""An Anthropic message's content blocks, built from a reply's parsed pieces, with the events that stream
them: `content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`, `input_json_delta`),
`content_block_stop`. The whole message is the same builder with its events dropped.
"""
from __future__ import annotations

import json
from typing import Any

from tandem.frontend.http.reply import ReplyDelta

Event = dict[str, Any]
_DELTA = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


class MessageBuilder:
    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open: int | None = None  # index of the open block
        self._calls: dict[int, int] = {}  # tool call index -> block index
        self._args: dict[int, str] = {}  # block index -> a tool_use block's arguments text so far

    def add(self, d: ReplyDelta) -> list[Event]:
        events: list[Event] = []
        if d.reasoning:
            events += self._text("thinking", d.reasoning)
        # Text after a call (its block closed) goes after it; text before one, before it.
        after_call = bool(self._calls) and (
            self._open is None or self.blocks[self._open]["type"] == "tool_use"
        )
        if after_call:
            events += self._call_parts(d.tool_calls)
        if d.content:
            events += self._text("text", d.content)
        if not after_call:
            events += self._call_parts(d.tool_calls)
        return events

    def finish(self) -> list[Event]:
        return self._close()

    def content(self) -> list[dict]:
        """The message's blocks; a tool_use block's input is its arguments parsed ({} if cut off)."""
        out = []
        for i, b in enumerate(self.blocks):
            if b["type"] == "tool_use":
                try:
                    parsed = json.loads(self._args[i] or "{}")
                except ValueError:
                    parsed = {}
                b = {**b, "input": parsed if isinstance(parsed, dict) else {}}
            out.append(b)
        return out

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.blocks[self._open]["type"] != kind:
            events += self._close()
            block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            events += self._start(block)
        index = self._open
        assert index is not None
        self.blocks[index][kind] += text
        delta_type, key = _DELTA[kind]
        events.append(
            {"type": "content_block_delta", "index": index, "delta": {"type": delta_type, key: text}}
        )
        return events

    def _call_parts(self, parts: list[dict]) -> list[Event]:
        events: list[Event] = []
        for p in parts:
            if "id" in p:
                events += self._close()
                events += self._start(
                    {"type": "tool_use", "id": p["id"], "name": p["function"]["name"], "input": {}}
                )
                self._calls[p["index"]] = index = len(self.blocks) - 1
                self._args[index] = ""
            args = p["function"]["arguments"]
            if args:
                index = self._calls[p["index"]]
                self._args[index] += args
                events.append({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta", "partial_json": args}})
        return events

    def _start(self, block: dict) -> list[Event]:
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

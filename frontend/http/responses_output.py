"""A response's output items, built from a reply's parsed pieces, with the typed events that stream them.

Items open as the reply gets to them: a reasoning item, a message, a function call per call. Each event is
a dict with its `type` and a `sequence_number`; a whole (non-streamed) response is the same builder with
its events dropped, so the two cannot differ.
"""
from __future__ import annotations

import uuid
from typing import Any

from tandem.frontend.http.reply import ReplyDelta, ReplyParser

Event = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head  # id, model, created_at and the request's settings echoed back
        self.output: list[dict] = []
        self.status = "in_progress"
        self.usage: dict | None = None
        self.incomplete_details: dict | None = None
        self._seq = 0
        self._open: int | None = None  # output index of the open reasoning or message item
        self._calls: dict[int, int] = {}  # tool call index -> output index

    def body(self) -> dict:
        # `usage` is not nullable in the published schema: absent until the response is done.
        usage = {} if self.usage is None else {"usage": self.usage}
        return {**self.head, "status": self.status, "output": self.output, **usage,
                "incomplete_details": self.incomplete_details, "error": None}

    def event(self, type_: str, **fields: Any) -> Event:
        self._seq += 1
        return {"type": type_, "sequence_number": self._seq - 1, **fields}

    def start(self) -> list[Event]:
        return [self.event("response.created", response=self.body()),
                self.event("response.in_progress", response=self.body())]

    def add(self, d: ReplyDelta) -> list[Event]:
        events: list[Event] = []
        if d.reasoning:
            events += self._text("reasoning", d.reasoning)
        # Text after a call (the call's block closed) goes after it; text before one, before it.
        after_call = self._open is None and bool(self._calls)
        if after_call:
            events += self._call_parts(d.tool_calls)
        if d.content:
            events += self._text("message", d.content)
        if not after_call:
            events += self._call_parts(d.tool_calls)
        return events

    def finish(self, reply: ReplyParser, usage: dict) -> list[Event]:
        """The reply ended: items close, the response completes (or is incomplete when cut off)."""
        cut = reply.finish_reason == "length"
        events = self._close(cut)
        self.status = "incomplete" if cut else "completed"
        self.incomplete_details = {"reason": "max_output_tokens"} if cut else None
        self.usage = usage
        events.append(
            self.event("response.incomplete" if cut else "response.completed", response=self.body())
        )
        return events

    # --- items ---

    def _text(self, kind: str, text: str) -> list[Event]:
        """Reasoning or message text: into the open item of that kind, opening one if need be."""
        events: list[Event] = []
        if self._open is None or self.output[self._open]["type"] != kind:
            events += self._close(False)
            events += self._open_item(kind)
        index = self._open
        assert index is not None
        item = self.output[index]
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=item["id"], output_index=index, content_index=0, delta=text,
                                  **extra))
        return events

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item: dict = {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part: dict = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "type": "message",
                "id": _id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        self._open = index = len(self.output) - 1
        events = [self.event("response.output_item.added", output_index=index, item=_copy(item))]
        item["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part)))
        return events

    def _close(self, cut: bool) -> list[Event]:
        """The open items end: text that was open, and calls (a call's arguments are whole once the reply
        has moved on)."""
        events: list[Event] = []
        for index in self._calls.values():
            if self.output[index]["status"] == "in_progress":
                events += self._close_call(index, cut)
        if self._open is None:
            return events
        index, self._open = self._open, None
        item = self.output[index]
        item["status"] = "incomplete" if cut else "completed"
        part = item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return events + [
            self.event(
                done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra
            ),
            self.event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            ),
            self.event("response.output_item.done", output_index=index, item=_copy(item)),
        ]

    def _call_parts(self, parts: list[dict]) -> list[Event]:
        events: list[Event] = []
        for p in parts:
            if "id" in p:  # a new call: its own item, after whatever was open
                events += self._close(False)
                item = {
                    "type": "function_call",
                    "id": _id("fc"),
                    "call_id": p["id"],
                    "name": p["function"]["name"],
                    "arguments": "",
                    "status": "in_progress",
                }
                self.output.append(item)
                self._calls[p["index"]] = len(self.output) - 1
                events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                          item=dict(item)))
            args = p["function"]["arguments"]
            if args:
                index = self._calls[p["index"]]
                self.output[index]["arguments"] += args
                events.append(self.event("response.function_call_arguments.delta",
                                          item_id=self.output[index]["id"], output_index=index, delta=args))
        return events

    def _close_call(self, index: int, cut: bool) -> list[Event]:
        item = self.output[index]
        item["status"] = "incomplete" if cut else "completed"
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=dict(item))]


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(p) for p in item["content"]]}

"""Tool calls out of a chat choice's text, incrementally: content and call deltas as the text grows.

Three shapes of output, one per way tools are offered:
- `auto`: the Hermes/Qwen format, content with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks. Content streams as it comes; only a possible partial tag (and the whitespace before it) is held.
  A block turns into a call once its name is known and its arguments object opens; text that never gets
  there (not JSON, no name) goes out as content after all, never as a half-parsed call.
- `required`: the grammar forces a JSON array of `{"name", "arguments"}` objects.
- a named function: the grammar forces the arguments object itself.

A call's arguments are the raw text of its `arguments` value, so the fragments streamed are exactly the
arguments of the whole response (which is this same parser fed the whole text at once).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")
_SCALAR = set("0123456789+-.eEtruefalsn")


class _CallObject:
    """One call's JSON object, char by char: the raw span of each top-level value (end None while open).

    Lenient below the top level (it counts brackets and strings), strict at it, so text that is not a
    call object fails early."""

    def __init__(self) -> None:
        self.raw: list[str] = []
        self.spans: dict[str, list[int | None]] = {}
        self.depth = 0
        self.in_str = self.esc = False
        self.state = "start"  # start, key, colon, value_start, value, after_value
        self.key_start = 0
        self.key = ""
        self.closed = self.bad = False

    def push(self, ch: str) -> None:
        pos = len(self.raw)
        self.raw.append(ch)
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1 and self.state == "key":
                    key = self.decode(self.key_start, pos + 1)
                    self.bad, self.key, self.state = key is None, key or "", "colon"
                elif self.depth == 1:  # a string value at the top level
                    self._end(pos + 1)
            return
        if ch.isspace():
            return
        if self.depth > 1:
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._end(pos + 1)
            elif ch == '"':
                self.in_str = True
            return
        if self.state == "start":
            self.bad = ch != "{"
            self.depth, self.state = 1, "key"
        elif self.state == "key" and ch == '"':
            self.in_str, self.key_start = True, pos
        elif self.state in ("key", "after_value") and ch == "}":
            self.closed, self.depth = True, 0
        elif self.state == "after_value" and ch == ",":
            self.state = "key"
        elif self.state == "colon" and ch == ":":
            self.state = "value_start"
        elif self.state == "value_start":
            self.spans[self.key] = [pos, None]
            self.state = "value"
            if ch in "{[":
                self.depth += 1
            elif ch == '"':
                self.in_str = True
            else:
                self.bad = ch not in _SCALAR
        elif self.state == "value" and ch in ",}":  # a scalar ends
            self._end(self._last_nonspace(pos) + 1)
            self.closed, self.state = ch == "}", "key"
            self.depth = 0 if self.closed else 1
        elif self.state == "value":
            self.bad = ch not in _SCALAR
        else:
            self.bad = True

    def _end(self, end: int) -> None:
        self.spans[self.key][1] = end
        self.state = "after_value"

    def _last_nonspace(self, pos: int) -> int:
        i = pos - 1
        while self.raw[i].isspace():
            i -= 1
        return i

    def decode(self, start: int, end: int) -> str | None:
        """A complete JSON string literal's value (None for a bad escape)."""
        try:
            return json.loads("".join(self.raw[start:end]))
        except ValueError:
            return None

    def text(self, key: str) -> str | None:
        """The raw text of a value so far (None when the key has not appeared)."""
        span = self.spans.get(key)
        if span is None:
            return None
        return "".join(self.raw[span[0]:span[1] if span[1] is not None else len(self.raw)])

    def name(self) -> str | None:
        """The call's name once its string value is complete."""
        span = self.spans.get("name")
        if span is None or span[1] is None or self.raw[span[0]] != '"':
            return None
        return self.decode(span[0], span[1])

    def arguments_key(self) -> str | None:
        return next((k for k in _ARGUMENT_KEYS if k in self.spans), None)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str = ""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedDelta:
    """What one piece of text adds: content, and tool-call entries in OpenAI's streaming shape."""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallParser:
    """Feed a choice's text as it comes; `content` and `calls` add up what has been handed out."""

    def __init__(self, mode: Literal["auto", "required", "named"], named: str | None = None) -> None:
        self.mode = mode
        self.calls: list[ParsedToolCall] = []
        self.content = ""
        self._out = ParsedDelta()
        self._held = ""  # auto: whitespace and a possible partial tag
        self._lead = ""  # auto: the whitespace before the open block's tag
        self._obj: _CallObject | None = None
        self._call_out = False  # the current object's call has gone out (its arguments may still stream)
        self._after_call = False  # auto: a call just closed; skip whitespace and its closing tag
        self._array = "before"  # required: before, inside, done
        if mode == "named":
            if named is None:
                raise ValueError("a named tool choice needs its function's name")
            self._start_call(named, "")

    def feed(self, text: str) -> ParsedDelta:
        for ch in text:
            if self.mode == "named":
                self._args(0, ch)
            elif self.mode == "required":
                self._required(ch)
            else:
                self._auto(ch)
        return self._take()

    def finish(self) -> ParsedDelta:
        """The end of the text: what was held goes out; a block that never became a call is content."""
        if self.mode == "auto":
            if self._obj is not None and not self._call_out:
                self._emit_content(self._lead + OPEN + "".join(self._obj.raw))
            elif self._obj is None and not self._after_call:
                self._emit_content(self._held)  # a partial closing tag after a call is dropped
            self._obj, self._held = None, ""
        return self._take()

    # --- the three shapes ---

    def _auto(self, ch: str) -> None:
        if self._obj is not None:
            self._object_char(ch)
            return
        if self._after_call:
            if ch.isspace() and not self._held:
                return
            self._held += ch
            if CLOSE.startswith(self._held):
                if self._held == CLOSE:
                    self._held = ""
                return
            self._after_call, pending, self._held = False, self._held, ""
            for c in pending:
                self._auto(c)
            return
        self._held += ch
        if self._held.endswith(OPEN):
            # The whitespace before a call is dropped, unless the block turns out not to be one.
            self._lead, self._held, self._obj = self._held[:-len(OPEN)], "", _CallObject()
            return
        keep = self._partial_tag_len(self._held)
        body = self._held[:len(self._held) - keep]
        ws = len(body) - len(body.rstrip())
        self._emit_content(body[:len(body) - ws])
        self._held = self._held[len(body) - ws:]

    @staticmethod
    def _partial_tag_len(s: str) -> int:
        for n in range(min(len(OPEN) - 1, len(s)), 0, -1):
            if OPEN.startswith(s[-n:]):
                return n
        return 0

    def _required(self, ch: str) -> None:
        if self._obj is not None:
            self._object_char(ch)
        elif self._array == "before" and ch == "[":
            self._array = "inside"
        elif self._array == "inside" and ch == "{":
            self._obj = _CallObject()
            self._obj.push(ch)
        elif self._array == "inside" and ch == "]":
            self._array = "done"

    def _object_char(self, ch: str) -> None:
        obj = self._obj
        assert obj is not None
        obj.push(ch)
        if self._call_out and obj.bad:  # the call is out; what follows its arguments is not ours
            self._obj, self._call_out, self._after_call = None, False, self.mode == "auto"
            if self.mode == "auto":
                self._auto(ch)
            return
        if self._call_out:
            end = obj.spans[obj.arguments_key() or ""][1]
            if end is None or end == len(obj.raw):  # this char is the arguments' (perhaps their last)
                self._args(len(self.calls) - 1, ch)
        elif obj.bad:
            self._fail()
            return
        else:
            self._maybe_start()
        if obj.closed:
            if not self._call_out and not self._close_call():
                self._fail()
                return
            self._obj, self._call_out = None, False
            self._after_call = self.mode == "auto"

    def _maybe_start(self) -> None:
        """A call goes out once its name is known and its arguments object has opened."""
        obj = self._obj
        assert obj is not None
        key, name = obj.arguments_key(), obj.name()
        args = obj.text(key) if key is not None else None
        if name is not None and args is not None and args.startswith("{") and obj.spans[key][1] is None:  # type: ignore[index]
            self._start_call(name, args)
            self._call_out = True

    def _close_call(self) -> bool:
        """The object closed before its call went out: out it goes whole, if it is one."""
        obj = self._obj
        assert obj is not None
        name = obj.name()
        if name is None:
            return False
        key = obj.arguments_key()
        args = obj.text(key) or "" if key is not None else "{}"
        if key is not None and args.startswith('"'):
            start, end = obj.spans[key]
            args = obj.decode(start, end or 0) or args  # arguments given as a JSON string
        self._start_call(name, args)
        return True

    def _fail(self) -> None:
        """Not a call after all: the block's text is content, and its failing char is scanned again
        (it may open a tag)."""
        obj = self._obj
        assert obj is not None
        self._obj = None
        if self.mode != "auto":
            self._array = "done"  # the grammar makes this unreachable; stop rather than guess
            return
        self._emit_content(self._lead + OPEN + "".join(obj.raw[:-1]))
        self._auto(obj.raw[-1])

    # --- output ---

    def _start_call(self, name: str, args: str) -> None:
        self.calls.append(ParsedToolCall(name, args))
        self._out.tool_calls.append({"index": len(self.calls) - 1, **self.calls[-1].message()})

    def _args(self, index: int, text: str) -> None:
        self.calls[index].arguments += text
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += text
        else:
            self._out.tool_calls.append({"index": index, "function": {"arguments": text}})

    def _emit_content(self, text: str) -> None:
        self.content += text
        self._out.content += text

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

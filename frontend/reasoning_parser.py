"""A reply's reasoning (between the model's think markers) apart from its content, incrementally.

Two styles, as the models write them:
- `qwen3`: the output opens with `<think>` when the model reasons; an output that does not is all content.
- `deepseek-r1`: the output starts inside the reasoning (the chat template put `<think>` in the prompt, or
  the model writes it first): everything up to `</think>` is reasoning.
A qwen3-style prompt that itself ends inside an open think block (Qwen3's thinking-only templates) is read
as deepseek-r1 (`opens_reasoning`).

One think block per reply: after `</think>` the rest is content, markers included. The markers never show;
the whitespace the models put around them (after `<think>`, before `</think>`, after `</think>`) is dropped.
The parser reads char by char and holds only what may still turn out to be a marker (or the whitespace
before one), so any split of a reply into pieces yields the same reasoning and content as the whole.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass

from tandem.protocol.choices import ReasoningParserName

CHOICES: tuple[str, ...] = typing.get_args(ReasoningParserName)  # the styles, and `auto`

OPEN, CLOSE = "<think>", "</think>"
STYLES = tuple(c for c in CHOICES if c != "auto")


def check_style(style: str | None, allow_auto: bool = True) -> None:
    if style is not None and style not in (CHOICES if allow_auto else STYLES):
        raise ValueError(
            f"unknown reasoning parser {style!r}; choose from {', '.join(CHOICES if allow_auto else STYLES)}"
        )


def template_style(chat_template: str | dict[str, str] | None) -> str | None:
    """`auto`: a template that writes both think markers reasons in the qwen3 style (which reads a prompt
    ending inside `<think>` as deepseek-r1's); one without them has no reasoning to split."""
    if isinstance(chat_template, dict):  # named templates: the default one is the chat's
        chat_template = chat_template.get("default")
    if chat_template and OPEN in chat_template and CLOSE in chat_template:
        return "qwen3"
    return None


def opens_reasoning(prompt_tail: str) -> bool:
    """Does the prompt (its rendered end) leave a think block open, so that the reply starts inside it?"""
    at = prompt_tail.rfind(OPEN)
    return at >= 0 and prompt_tail.find(CLOSE, at) < 0


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Feed a reply's text as it comes; `reasoning` and `content` add up what has been handed out."""

    def __init__(self, style: str, prompt_opened: bool = False) -> None:
        check_style(style, allow_auto=False)
        self.in_reasoning_first = style == "deepseek-r1" or prompt_opened
        self.state = "start"  # start, reasoning, content
        self.reasoning = ""
        self.content = ""
        self._held = ""
        self._strip_lead = False  # drop the whitespace that opens the next section
        self._out = ReasoningDelta()

    def feed(self, text: str) -> ReasoningDelta:
        for ch in text:
            self._char(ch)
        return self._take()

    def finish(self) -> ReasoningDelta:
        """The end of the reply: what was held goes out (a cut-off reasoning keeps its text)."""
        held, self._held = self._held, ""
        if self.state == "start":
            if self.in_reasoning_first:
                self._enter_reasoning()
                self._emit(held.strip(), reasoning=True)
            else:
                self._emit(held, reasoning=False)
        elif self.state == "reasoning":
            self._emit(held.rstrip(), reasoning=True)
        return self._take()

    def _char(self, ch: str) -> None:
        if self.state == "content":
            if self._strip_lead and ch.isspace():
                return
            self._strip_lead = False
            self._emit(ch, reasoning=False)
            return
        if self.state == "reasoning":
            self._reasoning_char(ch)
            return
        # start: leading whitespace, then perhaps the opening marker
        self._held += ch
        body = self._held.lstrip()
        if body == OPEN:
            self._held = ""
            self._enter_reasoning()
        elif not OPEN.startswith(body):
            pending, self._held = self._held, ""
            if self.in_reasoning_first:
                self._enter_reasoning()
            else:
                self.state = "content"
            for c in pending:
                self._char(c)

    def _enter_reasoning(self) -> None:
        self.state, self._strip_lead = "reasoning", True

    def _reasoning_char(self, ch: str) -> None:
        if self._strip_lead and ch.isspace():
            return
        self._strip_lead = False
        self._held += ch
        if self._held.endswith(CLOSE):
            self._emit(self._held[:-len(CLOSE)].rstrip(), reasoning=True)
            self._held, self.state, self._strip_lead = "", "content", True
            return
        # Hold the trailing whitespace and whatever may be the start of the closing marker.
        keep = next((n for n in range(min(len(CLOSE) - 1, len(self._held)), 0, -1)
                     if CLOSE.startswith(self._held[-n:])), 0)
        body = self._held[:len(self._held) - keep]
        cut = len(body.rstrip())
        self._emit(self._held[:cut], reasoning=True)
        self._held = self._held[cut:]

    def _emit(self, text: str, reasoning: bool) -> None:
        if not text:
            return
        if reasoning:
            self.reasoning += text
            self._out.reasoning += text
        else:
            self.content += text
            self._out.content += text

    def _take(self) -> ReasoningDelta:
        out, self._out = self._out, ReasoningDelta()
        return out


def split_reasoning(text: str, style: str, prompt_opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply; reasoning is None when there is none."""
    p = ReasoningParser(style, prompt_opened)
    p.feed(text)
    p.finish()
    return p.reasoning or None, p.content

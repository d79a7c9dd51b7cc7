"""What the client hands back: a finished Completion, or a streamed CompletionDelta."""
from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import RequestOutput


@dataclass
class CompletionDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        if out.finished:
            self.finish_reason = out.finish_reason
            self.matched_stop = out.matched_stop
            self.prompt_tokens = out.prompt_tokens
            self.completion_tokens = out.completion_tokens


def to_delta(out: RequestOutput) -> CompletionDelta:
    return CompletionDelta(out.rid, out.text, out.token_ids, out.finished, out.finish_reason)

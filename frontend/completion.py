"""What the client hands back: a finished Completion, or a streamed CompletionDelta. How the request ended
is the engine's one `final` record (protocol/final_info.py); finish_reason, metrics, the token counts and
the rest are read through it."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.frontend.reasoning_parser import split_reasoning
from tandem.protocol.final_info import FinalInfo, HasFinal
from tandem.protocol.messages import EngineLoad, Logprobs, RequestOutput


@dataclass
class CompletionDelta(HasFinal):
    request_id: str
    text: str
    token_ids: list[int]
    final: FinalInfo | None = None  # with the final delta
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    load: EngineLoad | None = None  # the engine's gauges when this delta left the scheduler


@dataclass
class Completion(HasFinal):
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Column-wise (see protocol.messages.Logprobs); None unless the request asked.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    final: FinalInfo | None = None
    # The reasoning style of the client that made it (Client(..., reasoning_parser=...)), or None.
    reasoning_style: str | None = field(default=None, repr=False)

    @property
    def reasoning_text(self) -> str | None:
        """The text between the model's think markers (None without a reasoning parser or reasoning)."""
        return split_reasoning(self.text, self.reasoning_style)[0] if self.reasoning_style else None

    @property
    def content(self) -> str:
        """The reply without its reasoning and markers (the whole text without a reasoning parser)."""
        return split_reasoning(self.text, self.reasoning_style)[1] if self.reasoning_style else self.text

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            self.logprobs = _joined(self.logprobs, out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = _joined(self.prompt_logprobs, out.prompt_logprobs)
        if out.final is not None:
            self.final = out.final


def _joined(acc: Logprobs | None, more: Logprobs) -> Logprobs:
    if acc is None:
        return Logprobs(
            list(more.token_ids), list(more.logprobs), list(more.top_ids), list(more.top_logprobs)
        )
    acc.extend(more)
    return acc


def to_delta(out: RequestOutput) -> CompletionDelta:
    return CompletionDelta(out.rid, out.text, out.token_ids, out.final, out.logprobs, out.prompt_logprobs,
                           out.load)

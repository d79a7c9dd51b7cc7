"""What the client hands back: a finished Completion, or a streamed CompletionDelta."""
from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import EngineLoad, Logprobs, RequestOutput
from protocol.time_stats import TimeStats


@dataclass
class CompletionDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # With the final delta: token counts, the scheduler's timeline of the request, its prefix-cache hit.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    metrics: TimeStats | None = None
    cached_tokens: int = 0
    load: EngineLoad | None = None  # the engine's gauges when this delta left the scheduler


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Column-wise (see protocol.messages.Logprobs); None unless the request asked.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # The scheduler's timeline: metrics.queue_s, .ttft_s, .decode_s, .e2e_s, .retractions.
    metrics: TimeStats | None = None
    cached_tokens: int = 0
    spec_accepted_tokens: int = 0  # draft tokens accepted (speculative decoding)

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            self.logprobs = _joined(self.logprobs, out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = _joined(self.prompt_logprobs, out.prompt_logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.matched_stop = out.matched_stop
            self.prompt_tokens = out.prompt_tokens
            self.completion_tokens = out.completion_tokens
            self.metrics = out.time_stats
            self.cached_tokens = out.cached_tokens
            self.spec_accepted_tokens = out.spec_accepted_tokens


def _joined(acc: Logprobs | None, more: Logprobs) -> Logprobs:
    if acc is None:
        return Logprobs(list(more.token_ids), list(more.logprobs), list(more.top_ids), list(more.top_logprobs))
    acc.extend(more)
    return acc


def to_delta(out: RequestOutput) -> CompletionDelta:
    return CompletionDelta(
        out.rid, out.text, out.token_ids, out.finished, out.finish_reason, out.logprobs, out.prompt_logprobs,
        out.prompt_tokens, out.completion_tokens, out.time_stats, out.cached_tokens, out.load,
    )

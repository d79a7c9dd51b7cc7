"""How a request ended: one record, made once where it ends (the scheduler) and carried unchanged through
the detokenizer to the client's Completion and the HTTP layer."""
from __future__ import annotations

import msgspec

from tandem.protocol.time_stats import TimeStats


class FinalInfo(msgspec.Struct, array_like=True):
    finish_reason: str  # "stop" | "length" | "abort" (an error ends the request with RequestError)
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    spec_accepted_tokens: int = 0  # draft tokens accepted (speculative decoding)
    time_stats: TimeStats | None = None
    prefix_source: str = "none"  # where its cached prefix came from: none, device, host or session


class HasFinal:
    """Views of the `final` record for whatever carries one (messages, Completion, CompletionDelta)."""

    __slots__ = ()
    final: FinalInfo | None

    @property
    def finished(self) -> bool:
        return self.final is not None

    @property
    def finish_reason(self) -> str | None:
        return self.final.finish_reason if self.final else None

    @property
    def matched_stop(self) -> int | str | None:
        return self.final.matched_stop if self.final else None

    @property
    def prompt_tokens(self) -> int:
        return self.final.prompt_tokens if self.final else 0

    @property
    def completion_tokens(self) -> int:
        return self.final.completion_tokens if self.final else 0

    @property
    def cached_tokens(self) -> int:
        return self.final.cached_tokens if self.final else 0

    @property
    def spec_accepted_tokens(self) -> int:
        return self.final.spec_accepted_tokens if self.final else 0

    @property
    def prefix_source(self) -> str:
        return self.final.prefix_source if self.final else "none"

    @property
    def metrics(self) -> TimeStats | None:
        """The scheduler's timeline: metrics.queue_s, .ttft_s, .decode_s, .e2e_s, .retractions."""
        return self.final.time_stats if self.final else None

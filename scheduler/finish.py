"""Why a request ended. `kind` is what the client sees as finish_reason."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.protocol.errors import ErrorCode


@dataclass(frozen=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort" | "error"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str = ""  # for abort/error: why
    cut: int = 0  # for a stop string: characters to cut from the end of the output text
    code: str = ""  # for error: its ErrorCode (a str: a worker's code arrives as one)

    @classmethod
    def stop(cls, matched: int | str | None = None, cut: int = 0) -> FinishReason:
        return cls("stop", matched, cut=cut)

    @classmethod
    def length(cls) -> FinishReason:
        return cls("length")

    @classmethod
    def abort(cls, message: str = "aborted by client") -> FinishReason:
        return cls("abort", message=message)

    @classmethod
    def error(cls, message: str, code: str = ErrorCode.REQUEST_FAILED) -> FinishReason:
        return cls("error", message=message, code=code)


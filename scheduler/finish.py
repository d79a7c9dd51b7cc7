"""Why a request ended (`FinishReason`, decided while it runs) and the record of it the client gets
(`final_info`, made once, when it ends)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.errors import ErrorCode
from protocol.final_info import FinalInfo

if TYPE_CHECKING:  # req.py imports this module
    from scheduler.req import Req


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


def final_info(req: Req, reason: FinishReason) -> FinalInfo:
    return FinalInfo(
        reason.kind, reason.matched, len(req.origin_input_ids), len(req.output_ids), req.cached_tokens,
        req.spec_accepted_tokens, req.time_stats,
    )

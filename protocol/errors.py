"""Typed errors that reach the client. The code is stable and machine-readable; the message is for people."""
from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Every code the engine sends; the value is the wire string that clients match. The part before the
    dot names the error class (see `error_from_code`)."""

    INTERNAL = "internal_error"
    GRAMMAR_COMPILER = "internal_error.grammar"
    INVALID_REQUEST = "invalid_request"
    MALFORMED = "invalid_request.malformed"
    TOO_LARGE = "invalid_request.too_large"
    BAD_RID = "invalid_request.rid"
    DUPLICATE_RID = "invalid_request.duplicate_rid"
    PARAMS = "invalid_request.params"
    PROMPT = "invalid_request.prompt"
    EMPTY_PROMPT = "invalid_request.empty_prompt"
    MESSAGES = "invalid_request.messages"
    TOKEN_ID = "invalid_request.token_id"
    PROMPT_TOO_LONG = "invalid_request.prompt_too_long"
    DIMENSIONS = "invalid_request.dimensions"
    IMAGE = "invalid_request.image"  # not an image, too large or too many, or sent to a text-only model
    LORA = "invalid_request.lora"  # no adapter served under that name, or one that cannot be served
    LORA_CONFLICT = "invalid_request.lora_conflict"  # an adapter is served under that name already
    INVALID_GRAMMAR = "invalid_request.grammar"
    SESSION = "invalid_request.session"  # a bad open_session (capacity, timeout) or sessions unavailable
    SESSION_UNKNOWN = "invalid_request.session_unknown"
    SESSION_CLOSED = "invalid_request.session_closed"  # closed, or timed out
    SESSION_TURN = "invalid_request.session_turn"  # no such finished turn in the session
    SESSION_CAPACITY = "invalid_request.session_capacity"  # past the session's or the engine's token cap
    REQUEST_FAILED = "request_failed"
    FRONTEND_FAILED = "request_failed.frontend"
    FAILED_INTERNAL = "request_failed.internal"
    OUT_OF_MEMORY = "request_failed.out_of_memory"
    KV_CAPACITY = "request_failed.kv_capacity"
    LORA_UNLOADED = "request_failed.lora_unloaded"  # its adapter was unloaded with abort_running
    LORA_BUSY = "request_failed.lora_busy"  # an unload that waited its bound for the adapter's requests
    GRAMMAR_REJECTED = "request_failed.grammar"
    GRAMMAR_FAILED = "request_failed.grammar_internal"
    GRAMMAR_TIMEOUT = "request_failed.grammar_timeout"
    CLIENT_NOT_READING = "request_failed.client_not_reading"
    OVERLOADED = "overloaded"
    ENGINE_DEAD = "engine_dead"
    DRAINING = "engine_dead.draining"  # the engine is draining (SIGTERM, POST /drain): no new requests
    DRAIN_TIMEOUT = "engine_dead.drain_timeout"  # still running when --drain-timeout-s ran out
    STALLED = "engine_dead.stalled"  # a step did not come back within --step-timeout-s
    UNREACHABLE = "engine_dead.unreachable"  # no engine answered at the client's endpoint within its bound

    def __str__(self) -> str:  # the wire string in logs and f-strings, not "ErrorCode.X"
        return self.value


class TandemError(Exception):
    # A str: a code from the wire may be one this version does not list (it still maps by its class prefix).
    code: str = ErrorCode.INTERNAL

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidRequestError(TandemError):
    """The request itself is wrong (bad parameter, empty or too long prompt, ...)."""

    code = ErrorCode.INVALID_REQUEST


class RequestFailedError(TandemError):
    """The engine accepted the request but could not complete it."""

    code = ErrorCode.REQUEST_FAILED


class OverloadedError(TandemError):
    """The engine's queue is full (max_waiting_requests): retry later."""

    code = ErrorCode.OVERLOADED


class EngineDeadError(TandemError):
    """The engine went away while a request was waiting on it, or is draining and takes no new ones."""

    code = ErrorCode.ENGINE_DEAD


def error_from_code(code: str, message: str) -> TandemError:
    for cls in (InvalidRequestError, RequestFailedError, OverloadedError, EngineDeadError):
        if code == cls.code or code.startswith(cls.code + "."):
            return cls(message, code)
    return TandemError(message, code)


class ModelLoadError(ValueError):
    """A model file or directory the engine cannot load (missing, broken, unsupported); names the file and
    what is wrong. Raised at startup, reported by the launcher; never crosses a socket."""

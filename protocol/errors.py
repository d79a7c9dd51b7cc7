"""Typed errors that reach the client. The code is stable and machine-readable; the message is for people."""
from __future__ import annotations


class TandemError(Exception):
    code = "internal_error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidRequestError(TandemError):
    """The request itself is wrong (bad parameter, empty or too long prompt, ...)."""

    code = "invalid_request"


class RequestFailedError(TandemError):
    """The engine accepted the request but could not complete it."""

    code = "request_failed"


class OverloadedError(TandemError):
    """The engine's queue is full (max_waiting_requests): retry later."""

    code = "overloaded"


class EngineDeadError(TandemError):
    """The engine went away while a request was waiting on it."""

    code = "engine_dead"


def error_from_code(code: str, message: str) -> TandemError:
    for cls in (InvalidRequestError, RequestFailedError, OverloadedError, EngineDeadError):
        if code == cls.code or code.startswith(cls.code + "."):
            return cls(message, code)
    return TandemError(message, code)


class ModelLoadError(ValueError):
    """A model file or directory the engine cannot load (missing, broken, unsupported); names the file and
    what is wrong. Raised at startup, reported by the launcher; never crosses a socket."""

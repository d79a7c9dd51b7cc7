"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol.errors import EngineDeadError, ErrorCode, InvalidRequestError, OverloadedError, TandemError
from protocol.messages import EngineStats

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": code}}


def draining(stats: EngineStats) -> APIError:
    return APIError(503, f"the engine is draining ({stats.draining}) and takes no new requests", None,
                    ErrorCode.DRAINING)


def from_engine(e: TandemError) -> APIError:
    """An engine error as the HTTP status a client expects: its fault 400 (413 too large), ours 503 / 500."""
    if e.code == ErrorCode.TOO_LARGE:
        return APIError(413, e.message, None, e.code)
    if isinstance(e, InvalidRequestError):
        return APIError(400, e.message, None, e.code)
    if isinstance(e, (EngineDeadError, OverloadedError)):
        return APIError(503, e.message, None, e.code)
    return APIError(500, e.message, None, e.code)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(TandemError)
    async def _engine(_: Request, e: TandemError) -> JSONResponse:
        return from_engine(e).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 (never 422), naming the field.
        found = [(".".join(str(x) for x in err.get("loc", ()) if x != "body"), err.get("msg", "invalid"))
                 for err in e.errors()] or [("", "invalid request")]
        message = "; ".join(f"{p}: {m}" if p else m for p, m in found)
        return APIError(400, message, found[0][0] or None, "invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail)).response()

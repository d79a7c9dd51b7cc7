"""Errors in the shape of the API a route belongs to, with the right status: OpenAI's
{"error": {"message", "type", "param", "code"}}, Anthropic's {"type": "error", "error": {"type",
"message"}} on the Messages API's routes, or ollama's {"error": "message"} on its /api/ routes."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.protocol.engine_stats import EngineStats
from tandem.protocol.errors import (
    EngineDeadError,
    ErrorCode,
    InvalidRequestError,
    OverloadedError,
    TandemError,
)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable",
          500: "internal_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error"}
ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self, path: str = "") -> JSONResponse:
        if path.startswith(ANTHROPIC_PREFIX):
            body = anthropic_error_body(self.status, self.message)
        elif path.startswith(OLLAMA_PREFIX):
            body = ollama_error_body(self.message)
        else:
            body = error_body(self.status, self.message, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": code}}


def draining(stats: EngineStats) -> APIError:
    return APIError(503, f"the engine is draining ({stats.draining}) and takes no new requests", None,
                    ErrorCode.DRAINING)


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def ollama_error_body(message: str) -> dict:
    return {"error": message}


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
    async def _api(request: Request, e: APIError) -> JSONResponse:
        return e.response(request.url.path)

    @app.exception_handler(TandemError)
    async def _engine(request: Request, e: TandemError) -> JSONResponse:
        return from_engine(e).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 (never 422), naming the field.
        found = [(".".join(str(x) for x in err.get("loc", ()) if x != "body"), err.get("msg", "invalid"))
                 for err in e.errors()] or [("", "invalid request")]
        message = "; ".join(f"{p}: {m}" if p else m for p, m in found)
        return APIError(400, message, found[0][0] or None, "invalid_value").response(request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        # A fault of ours still answers in the API's shape (starlette's default is a plain-text 500); it is
        # logged with its traceback by the server error middleware that calls this.
        return APIError(500, f"internal error: {type(e).__name__}", None, ErrorCode.INTERNAL).response(
            request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        response = APIError(e.status_code, str(e.detail)).response(request.url.path)
        response.headers.update(e.headers or {})  # e.g. a 405's Allow: the methods the route takes
        return response

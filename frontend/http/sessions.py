"""Sessions over HTTP (SGLang's routes): POST /open_session -> the session id (a JSON string), POST
/close_session; a completion or chat completion with `session_params` continues a turn of it. A turn's
id is its response's `id`: pass it as session_params.rid to branch from that turn."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tandem.frontend.client.async_client import SESSION_TIMEOUT_S
from tandem.frontend.http.errors import APIError
from tandem.frontend.http.openapi import BODY, ENGINE, answers
from tandem.frontend.http.schemas import CloseSessionRequest, OpenSessionRequest, SamplingBody
from tandem.frontend.http.state import ServerState
from tandem.protocol.messages import SessionParams


def session_of(body: SamplingBody, num_requests: int) -> SessionParams | None:
    """The session a request continues (None: none); it must be one engine request (one prompt, n=1)."""
    sp = body.session_params
    if sp is None:
        return None
    if num_requests != 1:
        raise APIError(400, "a request that continues a session takes one prompt and n=1", "session_params")
    return SessionParams(sp.id, sp.rid)


def add_session_routes(app: FastAPI, st: ServerState, dependencies: list[Any]) -> None:
    @app.post("/open_session", dependencies=dependencies, responses=answers(*BODY, 401, *ENGINE))
    async def open_session(body: OpenSessionRequest) -> str:
        session = await st.client.open_session(body.capacity_tokens, body.timeout or SESSION_TIMEOUT_S)
        return session.id

    @app.post("/close_session", dependencies=dependencies, responses=answers(*BODY, 401, *ENGINE))
    async def close_session(body: CloseSessionRequest) -> dict:
        await st.client.close_session(body.session_id)
        return {"session_id": body.session_id, "closed": True}

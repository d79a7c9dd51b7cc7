"""The many-model server's HTTP app: every route of the one-model server, routed by the request's `model`
to that model's engine (started on demand by the ModelPool), plus what only the router knows: the model
list with each model's state (/v1/models, /api/tags, /api/ps), the merged metrics, health and version.

A request's model comes from its JSON body's `model` (ollama's /api/show also takes `name`); with no model
and one model served, that one. Errors are in the route's API's shape (OpenAI, Anthropic, ollama)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from datetime import datetime, timezone
from typing import Any

import aiohttp
import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.frontend.http import errors
from tandem.frontend.http.chat_page import add_chat_page
from tandem.frontend.http.errors import APIError
from tandem.frontend.router.metrics_merge import merge_pages
from tandem.frontend.router.model_pool import LoadFailed, NoRoom, UnknownModel
from tandem.frontend.router.proxy import EngineUnreachable
from tandem.frontend.router.router_state import RouterState
from tandem.protocol.model_spec import bare_name, parse_keep_alive

METRICS_TIMEOUT_S = 5.0
_OPEN = ("/health", "/version", "/api/version", "/metrics")  # answered without the key, as one model's


def _ollama(path: str) -> bool:
    return path.startswith("/api/")


def _unknown(path: str, name: str, served: list[str]) -> APIError:
    if _ollama(path):
        return APIError(404, f"model '{name}' not found")
    return APIError(404, f"The model `{name}` does not exist; this server serves "
                    f"{', '.join(f'`{n}`' for n in served)}.", "model", "model_not_found")


def create_router_app(rs: RouterState) -> FastAPI:
    app = FastAPI(title="tandem", version=rs.version, docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    authed = [Depends(rs.check_key)]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    @app.get("/api/version")
    async def version_() -> dict:
        return {"version": rs.version}

    @app.get("/v1/models", dependencies=authed)
    async def models() -> dict:
        return {"object": "list", "data": [rs.openai_entry(e) for e in rs.pool.entries.values()]}

    @app.get("/api/tags", dependencies=authed)
    async def tags() -> dict:
        return {"models": [rs.ollama_entry(e, loaded=False) for e in rs.pool.entries.values()]}

    @app.get("/api/ps", dependencies=authed)
    async def ps() -> dict:
        return {"models": [rs.ollama_entry(e, loaded=True) for e in rs.pool.loaded()]}

    @app.get("/metrics")
    async def metrics() -> Response:
        rs.update_gauges()

        async def page(url: str) -> str:
            async with rs.http().get(url + "/metrics") as r:
                return await r.text() if r.status == 200 else ""

        loaded = [e.engine.url for e in rs.pool.loaded() if e.engine is not None]
        pages = await asyncio.gather(*(asyncio.wait_for(page(u), METRICS_TIMEOUT_S) for u in loaded),
                                     return_exceptions=True)
        return Response(merge_pages([p for p in pages if isinstance(p, str)], rs.registry),
                        media_type=CONTENT_TYPE_LATEST)

    if rs.admin_api_key is not None:
        @app.post("/drain", dependencies=[Depends(rs.check_admin_key)], status_code=202)
        async def drain() -> Response:
            """As SIGTERM: new requests are refused, running ones get --drain-timeout-s, every model stops."""
            os.kill(os.getpid(), signal.SIGTERM)
            return JSONResponse({"status": "draining", "running": sum(
                e.running for e in rs.pool.entries.values())}, status_code=202)

    add_chat_page(app)  # before the catch-all below, which would take `/` too

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def routed(path: str, request: Request) -> Response:
        path = request.url.path
        if path not in _OPEN:
            rs.check_key(request)
        body = await request.body()
        fields = _json_fields(body, path) if body else {}
        name = fields.get("model") or (fields.get("name") if path == "/api/show" else None)
        if name is None and request.method == "GET" and len(rs.pool.entries) > 1:
            return await _first_answer(rs, request, body)  # e.g. GET /v1/responses/{id}: whichever has it
        name = _pick(rs, path, name)
        keep = None
        if "keep_alive" in fields:
            try:
                keep = parse_keep_alive(fields["keep_alive"])
            except ValueError as e:
                raise APIError(400, str(e), "keep_alive") from None
        if path == "/api/show" and request.method == "POST":
            shown = await asyncio.to_thread(rs.show, rs.pool.entry(name))
            if shown is not None:
                return JSONResponse(shown)
        if keep == 0 and _ollama(path) and _no_prompt(path, fields):  # ollama's way to unload a model
            unloaded = await rs.pool.unload(name)
            return JSONResponse(_ollama_done(name, path, "unload" if unloaded else "load"))
        if "keep_alive" in fields and not _ollama(path):
            # the router's field: the other APIs' bodies are strict (an unknown key is a 400)
            body = msgspec.json.encode({k: v for k, v in fields.items() if k != "keep_alive"})
        return await _to_engine(rs, request, body, name, keep)

    return app


def _json_fields(body: bytes, path: str) -> dict[str, Any]:
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise APIError(400, "the request body must be a JSON object")
    name = doc.get("model")
    if name is not None and not isinstance(name, str):
        raise APIError(400, "`model` must be a string", "model")
    return doc


def _pick(rs: RouterState, path: str, name: Any) -> str:
    served = list(rs.pool.entries)
    if name is None or name == "":
        if len(served) == 1:
            return served[0]
        raise APIError(400, f"give `model`: this server serves {', '.join(served)}", "model")
    if not isinstance(name, str):
        raise APIError(400, "`model` must be a string", "model")
    bare = bare_name(name)
    if bare not in rs.pool.entries:
        raise _unknown(path, name, served)
    return bare


def _no_prompt(path: str, fields: dict[str, Any]) -> bool:
    if path == "/api/generate":
        return not fields.get("prompt")
    if path == "/api/chat":
        return not fields.get("messages")
    return False


def _ollama_done(name: str, path: str, reason: str) -> dict:
    now = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    out: dict[str, Any] = {"model": name, "created_at": now, "done": True, "done_reason": reason}
    if path == "/api/chat":
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return out


async def _to_engine(rs: RouterState, request: Request, body: bytes, name: str,
                     keep: float | None) -> Response:
    try:
        engine = await rs.pool.acquire(name, keep)
    except UnknownModel:
        raise _unknown(request.url.path, name, list(rs.pool.entries)) from None
    except NoRoom as e:
        raise APIError(503, str(e), "model", "no_room") from None
    except LoadFailed as e:
        raise APIError(500, str(e), "model", "model_load_failed") from None
    released = False

    def done() -> None:
        nonlocal released
        if not released:
            released = True
            rs.pool.release(name)

    try:
        return await rs.proxy.forward(request, body, engine.url, done)
    except EngineUnreachable as e:
        raise APIError(503, f"the engine of model `{name}` did not answer ({e}); it is restarted on the "
                       "next request", "model", "engine_unreachable") from None
    except BaseException:
        done()
        raise


async def _first_answer(rs: RouterState, request: Request, body: bytes) -> Response:
    """A GET naming no model (a stored response, say): the first loaded engine's answer that is not 404."""
    last: Response | None = None
    for e in rs.pool.loaded():
        with contextlib.suppress(APIError, aiohttp.ClientError):
            last = await _to_engine(rs, request, body, e.spec.name, None)
            if last.status_code != 404:
                return last
    if last is not None:
        return last
    raise APIError(404, f"nothing at {request.url.path} (no model is loaded)")

"""vLLM's routes to load and unload a LoRA adapter while serving, as operator routes: they exist only with
--admin-api-key and take its key (an adapter path is a file on the server). Each fault is typed: a bad
adapter 400 naming its field, a name taken 409, an unknown name 404, an unload that waited its bound 409;
the engine serves on."""
from __future__ import annotations

from collections.abc import Callable

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field

from tandem.frontend.http.errors import APIError
from tandem.frontend.http.openapi import BODY, ENGINE, answers
from tandem.frontend.http.schemas import Body
from tandem.frontend.http.state import ServerState
from tandem.protocol.errors import ErrorCode, TandemError
from tandem.protocol.lora_messages import MAX_UNLOAD_WAIT_S

_STATUS = {ErrorCode.LORA_CONFLICT: 409, ErrorCode.LORA_BUSY: 409}


class LoadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(Body):
    lora_name: str = Field(min_length=1, max_length=128)
    # tandem's: fail the adapter's running requests now rather than wait for them (up to timeout_s)
    abort_running: bool = False
    timeout_s: float = Field(default=30.0, ge=0, le=MAX_UNLOAD_WAIT_S)


def _typed(e: TandemError, param: str) -> APIError:
    if e.code == ErrorCode.LORA and "no LoRA adapter" in e.message:
        return APIError(404, e.message, param, "model_not_found")
    return APIError(_STATUS.get(e.code, 400 if e.code.startswith("invalid_request") else 500), e.message,
                    param, e.code)


def add_lora_routes(app: FastAPI, st: ServerState, check_admin_key: Callable[..., None]) -> None:
    admin = [Depends(check_admin_key)]

    @app.post("/v1/load_lora_adapter", dependencies=admin, responses=answers(*BODY, 401, 409, *ENGINE))
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> JSONResponse:
        try:
            generation = await st.client.load_lora(body.lora_name, body.lora_path)
        except TandemError as e:
            raise _typed(e, "lora_path") from None
        return JSONResponse({"status": "loaded", "lora_name": body.lora_name, "generation": generation})

    @app.post("/v1/unload_lora_adapter", dependencies=admin, responses=answers(*BODY, 401, 404, 409, *ENGINE))
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> JSONResponse:
        try:
            await st.client.unload_lora(body.lora_name, abort_running=body.abort_running,
                                        timeout_s=body.timeout_s)
        except TandemError as e:
            raise _typed(e, "lora_name") from None
        return JSONResponse({"status": "unloaded", "lora_name": body.lora_name})

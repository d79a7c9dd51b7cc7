"""POST /v1/embeddings in OpenAI's shape: each input one engine request (batched by the scheduler beside
everything else), the vectors as floats or base64 (float32, little-endian, as OpenAI encodes them)."""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Request
from pydantic import Field

from tandem.frontend.http.errors import APIError
from tandem.frontend.http.schemas import Body, TokenId
from tandem.frontend.http.state import ServerState
from tandem.frontend.http.streaming import until_disconnect
from tandem.protocol.errors import ErrorCode, InvalidRequestError

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(Body):
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    normalize: bool = True  # tandem's (vLLM's name), sent by the openai client as extra_body
    # lower first (--scheduling-policy priority)
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0


def _inputs(given: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    if isinstance(given, str):
        return [given]
    if not given:
        raise APIError(400, "input must not be empty", "input", "invalid_value")
    if isinstance(given[0], int):
        return [given]  # type: ignore[list-item]
    if len(given) > MAX_INPUTS:
        raise APIError(400, f"input has {len(given)} items; at most {MAX_INPUTS} per request", "input",
                       "invalid_value")
    return given  # type: ignore[return-value]


async def create_embedding(st: ServerState, body: EmbeddingRequest, request: Request) -> dict:
    if await st.check_model(body.model) is not None:
        raise APIError(400, "a LoRA adapter does not serve embeddings: name the base model", "model")
    inputs = _inputs(body.input)
    try:  # a client that leaves aborts what is left
        outs = await until_disconnect(request, st.client.embed_batch(
            inputs, dimensions=body.dimensions, normalize=body.normalize, priority=body.priority))
    except InvalidRequestError as e:
        param = "dimensions" if e.code == ErrorCode.DIMENSIONS else "input"
        raise APIError(400, e.message, param, e.code) from None
    for e in outs:
        st.metrics.on_final(e, e.load)
    b64 = body.encoding_format == "base64"
    data = [{"object": "embedding", "index": i, "embedding": e.base64() if b64 else e.embedding}
            for i, e in enumerate(outs)]
    n = sum(e.prompt_tokens for e in outs)
    return {"object": "list", "data": data, "model": st.model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n}}

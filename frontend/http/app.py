"""The FastAPI app: OpenAI routes (completions, chat, Responses), Anthropic's Messages API, ollama's API,
tokenizer routes, health, version, metrics, and the info routes a router (sglang-router) reads from its
workers."""
from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.frontend.http import errors, openapi
from tandem.frontend.http.anthropic_messages import count_message_tokens, create_message
from tandem.frontend.http.anthropic_schema import CountTokensRequest, MessagesRequest
from tandem.frontend.http.chat import chat_prompt_ids
from tandem.frontend.http.chat_completions import create_chat_completion
from tandem.frontend.http.chat_page import add_chat_page
from tandem.frontend.http.completions import create_completion
from tandem.frontend.http.embeddings import EmbeddingRequest, create_embedding
from tandem.frontend.http.lora_routes import add_lora_routes
from tandem.frontend.http.ollama import add_ollama_routes
from tandem.frontend.http.openapi import BODY, ENGINE, answers
from tandem.frontend.http.responses import create_response, stored_response
from tandem.frontend.http.responses_schema import ResponsesRequest
from tandem.frontend.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.frontend.http.sessions import add_session_routes
from tandem.frontend.http.state import ServerState
from tandem.frontend.prompt_tokens import encode_text
from tandem.protocol.errors import TandemError

HEALTH_TIMEOUT_S = 5.0


def _version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"


def create_app(st: ServerState) -> FastAPI:
    app = FastAPI(title="tandem", version=_version(), docs_url=None, redoc_url=None)
    errors.install(app)
    openapi.install(app, [st.model_name], st.info.vocab_size)

    def check_key(request: Request) -> None:
        st.check_key(request)

    authed = [Depends(check_key)]

    generation = answers(*BODY, 401, 404, *ENGINE, stream=True)

    @app.post("/v1/completions", dependencies=authed, responses=generation)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(st, body, request)

    @app.post("/v1/chat/completions", dependencies=authed, responses=generation)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(st, body, request)

    add_session_routes(app, st, authed)

    @app.post("/v1/responses", dependencies=authed, responses=generation)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(st, body, request)

    @app.get("/v1/responses/{response_id}", dependencies=authed, responses=answers(401, 404))
    async def get_response(response_id: str) -> dict:
        return stored_response(st, response_id)

    @app.post("/v1/messages", dependencies=authed,
              responses=answers(*BODY, 401, 404, *ENGINE, anthropic=True, stream=True))
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(st, body, request)

    @app.post(
        "/v1/messages/count_tokens", dependencies=authed, responses=answers(*BODY, 401, 404, anthropic=True)
    )
    async def count_tokens(body: CountTokensRequest) -> dict:
        return await count_message_tokens(st, body)

    @app.post("/v1/embeddings", dependencies=authed, responses=answers(*BODY, 401, 404, *ENGINE))
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
        return await create_embedding(st, body, request)

    add_ollama_routes(app, st, authed)  # ollama's /api/chat, /api/generate, /api/embed, /api/tags, ...

    @app.get("/v1/models", dependencies=authed, responses=answers(401))
    async def models() -> dict:
        loras = await st.loras()  # the base, then each LoRA adapter with the base as its parent (as vLLM's)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": st.created, "owned_by": "tandem", "root": root,
            "parent": parent, "max_model_len": st.info.max_model_len,
        } for name, root, parent in [(st.model_name, st.model_path, None),
                                     *((n, p, st.model_name) for n, p in loras.items())]]}

    @app.post("/tokenize", dependencies=authed, responses=answers(*BODY, 401, 404))
    async def tokenize(body: TokenizeRequest) -> dict:
        await st.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise errors.APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids = chat_prompt_ids(st.tokenizer, body.messages, None, body.add_generation_prompt,
                              body.chat_template_kwargs)
        else:
            ids = encode_text(st.tokenizer, body.prompt, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": st.info.max_model_len}

    @app.post("/detokenize", dependencies=authed, responses=answers(*BODY, 401, 404))
    async def detokenize(body: DetokenizeRequest) -> dict:
        await st.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < st.info.vocab_size]
        if bad:
            raise errors.APIError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {st.info.vocab_size})", "tokens"
            )
        return {"prompt": st.tokenizer.decode(body.tokens)}

    @app.get("/health", response_class=Response, responses={200: {"description": "serving"}, **answers(503)})
    async def health() -> Response:
        # A round trip through frontend and scheduler: 200 only when the engine answers and takes requests.
        try:
            stats = await asyncio.wait_for(st.client.stats(), HEALTH_TIMEOUT_S)
        except (TandemError, asyncio.TimeoutError) as e:
            return JSONResponse(
                errors.error_body(503, f"engine not serving: {e or 'no answer'}"), status_code=503
            )
        if stats.draining:  # what a load balancer or Kubernetes' readiness probe needs to stop sending here
            return errors.draining(stats).response()
        return Response(status_code=200)

    if st.admin_api_key is not None:  # operator routes: only when the operator asked, behind their own key
        def check_admin_key(request: Request) -> None:
            st.check_admin_key(request)

        @app.post("/drain", dependencies=[Depends(check_admin_key)], status_code=202,
                  responses=answers(401, *ENGINE))
        async def drain() -> Response:
            """As SIGTERM: running requests finish (within --drain-timeout-s), new ones get 503, then the
            engine stops (for Kubernetes' preStop hook; needs --admin-api-key's key)."""
            stats = await st.client.drain("POST /drain")
            return JSONResponse({"status": "draining", "reason": stats.draining, "running": stats.running,
                                 "waiting": stats.waiting}, status_code=202)

        add_lora_routes(app, st, check_admin_key)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter

    @app.get("/version")
    async def version_() -> dict:
        return {"version": _version()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # sglang-router asks its workers for these when they join.
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict:
        return {"model_path": st.model_path, "tokenizer_path": st.model_path, "is_generation": True,
                "served_model_name": st.model_name}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict:
        return {"model_path": st.model_path, "served_model_name": st.model_name,
                "max_model_len": st.info.max_model_len, "version": _version()}

    add_chat_page(app)  # GET /: the browser chat page
    return app

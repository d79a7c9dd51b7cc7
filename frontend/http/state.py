"""What every route needs: the engine client, the tokenizer, the model's identity, the metrics, the reasoning
style, and the Responses API's store."""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tandem.frontend.client.async_client import AsyncClient
from tandem.frontend.http.errors import APIError
from tandem.frontend.http.image_sources import MediaPolicy
from tandem.frontend.http.metrics import Metrics
from tandem.frontend.http.response_store import ResponseStore
from tandem.frontend.image_prompt import ImagePrompter
from tandem.frontend.reasoning_parser import ReasoningParser, opens_reasoning
from tandem.protocol.model_info import ModelInfo
from tandem.protocol.model_spec import bare_name

PROMPT_TAIL = 32  # tokens of the prompt's end that show whether the template opened a think block


@dataclass
class ServerState:
    client: AsyncClient
    tokenizer: Any
    info: ModelInfo
    model_path: str
    model_name: str
    metrics: Metrics
    api_key: str | None = None
    reasoning: str | None = None  # the reasoning parser's style (auto already resolved), or None
    responses: ResponseStore = field(default_factory=ResponseStore)
    created: int = field(default_factory=lambda: int(time.time()))
    admin_api_key: str | None = None  # the operator routes exist only with one (see create_app)
    prompter: ImagePrompter | None = None  # a vision-language model's processor (frontend/image_prompt.py)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where an image URL may point
    _texts: dict[int, str] = field(default_factory=dict)

    def token_text(self, tid: int) -> str:
        """A token's own text, as OpenAI's logprobs show it (cached: the vocabulary is fixed)."""
        t = self._texts.get(tid)
        if t is None:
            t = self._texts[tid] = self.tokenizer.decode([tid])
        return t

    async def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model, or no name); 404 for a name
        served by neither. ollama's clients name a model with its tag (`name:latest`, the only tag here).
        The engine's adapters come and go (load_lora): it is asked which it serves."""
        if name is None or name == self.model_name or bare_name(name) == self.model_name:
            return None
        loras = await self.loras()
        for n in (name, bare_name(name)):
            if n in loras:
                return n
        served = ", ".join(f"`{n}`" for n in [self.model_name, *loras])
        raise APIError(404, f"The model `{name}` does not exist; this server serves {served}.", "model",
                       "model_not_found")

    async def loras(self) -> dict[str, str]:
        """The LoRA adapters the engine serves now: name -> path."""
        return (await self.client.stats()).loras

    def reasoning_parser(self, prompt_ids: list[int]) -> ReasoningParser | None:
        """A reply's parser, told whether the prompt's end (the template's doing) opened a think block."""
        if self.reasoning is None:
            return None
        return ReasoningParser(
            self.reasoning, opens_reasoning(self.tokenizer.decode(prompt_ids[-PROMPT_TAIL:]))
        )

    def check_key(self, request: Request) -> None:
        check_key(request, self.api_key)

    def check_admin_key(self, request: Request) -> None:
        check_admin_key(request, self.admin_api_key)


def check_key(request: Request, key: str | None) -> None:
    """The inference routes: KEY, when the server has one."""
    if key is not None and not key_matches(request, key):
        raise APIError(401, "Incorrect API key provided.", None, "invalid_api_key")


def check_admin_key(request: Request, key: str | None) -> None:
    """Operator routes: the admin key only (the inference key is just another wrong key here)."""
    if key is None or not key_matches(request, key):
        raise APIError(401, "Incorrect admin key provided.", None, "invalid_admin_key")


def key_matches(request: Request, key: str) -> bool:
    # OpenAI's clients send a bearer token, Anthropic's an x-api-key header: the same key either way.
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    # Constant time: how much of a guess matches must not show in the response time.
    return hmac.compare_digest(given.encode(), key.encode())

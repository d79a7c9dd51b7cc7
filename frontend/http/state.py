"""What every route needs: the engine client, the tokenizer, the model's identity and the metrics."""
from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from frontend.client.async_client import AsyncClient
from frontend.http.errors import APIError
from frontend.http.metrics import Metrics
from protocol.model_info import ModelInfo


@dataclass
class ServerState:
    client: AsyncClient
    tokenizer: Any
    info: ModelInfo
    model_path: str
    model_name: str
    metrics: Metrics
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _texts: dict[int, str] = field(default_factory=dict)

    def token_text(self, tid: int) -> str:
        """A token's own text, as OpenAI's logprobs show it (cached: the vocabulary is fixed)."""
        t = self._texts.get(tid)
        if t is None:
            t = self._texts[tid] = self.tokenizer.decode([tid])
        return t

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else ""
        # Constant time: how much of a guess matches must not show in the response time.
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", None, "invalid_api_key")

"""What the many-model app's routes need: the pool, the proxy, the keys, the router's own metrics, and each
model's listing (as OpenAI's /v1/models and ollama's /api/tags, /api/ps write them)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import aiohttp
from fastapi import Request
from prometheus_client import CollectorRegistry, Gauge

from tandem.frontend.http.state import check_admin_key, check_key
from tandem.frontend.router.model_pool import ModelEntry, ModelPool
from tandem.frontend.router.proxy import Proxy
from tandem.protocol.model_info import ModelInfo, read_model_info
from tandem.protocol.model_spec import ModelSpec


@dataclass
class RouterState:
    pool: ModelPool
    proxy: Proxy
    version: str
    # a model's path on disk, or None while it is not there (nothing is pulled to list a model)
    locate: Callable[[ModelSpec], str | None]
    api_key: str | None = None
    reasoning_parser: str | None = None  # the serve option, for /api/show's `thinking` capability
    admin_api_key: str | None = None  # POST /drain is served only with one
    created: int = field(default_factory=lambda: int(time.time()))
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _infos: dict[str, tuple[str, ModelInfo] | None] = field(default_factory=dict)
    _http: aiohttp.ClientSession | None = None
    _tokenizers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        r, lab = self.registry, ["model_name"]
        self._loaded = Gauge("tandem:model_loaded", "1 when the model's engine is loaded", lab, registry=r)
        self._running = Gauge("tandem:model_requests_running", "requests routed to the model, not ended",
                              lab, registry=r)
        self._loads = Gauge("tandem:model_loads", "times the model's engine was started", lab, registry=r)

    def check_key(self, request: Request) -> None:
        check_key(request, self.api_key)

    def check_admin_key(self, request: Request) -> None:
        check_admin_key(request, self.admin_api_key)

    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        await self.proxy.close()

    def update_gauges(self) -> None:
        for name, e in self.pool.entries.items():
            self._loaded.labels(name).set(1 if e.state == "loaded" else 0)
            self._running.labels(name).set(e.running)
            self._loads.labels(name).set(e.loads)

    def model_info(self, e: ModelEntry) -> tuple[str, ModelInfo] | None:
        """(path, info) of a model on disk, read once; None while it is not pulled (nothing is pulled to
        list it)."""
        name = e.spec.name
        if self._infos.get(name) is None:
            path = self.locate(e.spec)
            if path is None:
                return None
            try:
                self._infos[name] = (path, read_model_info(path, e.spec.options.get("max_model_len")))
            except (OSError, ValueError, KeyError):
                return None
        return self._infos[name]

    def openai_entry(self, e: ModelEntry) -> dict[str, Any]:
        found = self.model_info(e)
        out: dict[str, Any] = {
            "id": e.spec.name, "object": "model", "created": self.created, "owned_by": "tandem",
            "root": found[0] if found else e.spec.model, "parent": None,
            "max_model_len": found[1].max_model_len if found else None,
            "state": e.state, "pinned": e.spec.pinned,
        }
        if e.error is not None and e.state != "loaded":
            out["error"] = e.error
        return out

    def show(self, e: ModelEntry) -> dict[str, Any] | None:
        """ollama's /api/show for a model on disk, without loading it (a tool lists every model so); None
        when it is not on disk (the request then loads it, pulling it)."""
        from tandem.frontend.http.ollama_models import chat_template, ollama_show
        from tandem.frontend.reasoning_parser import template_style
        from tandem.protocol.tokenizer_loader import load_tokenizer

        found = self.model_info(e)
        if found is None:
            return None
        path, info = found
        tok = self._tokenizers.get(path)
        if tok is None:
            tok = self._tokenizers[path] = load_tokenizer(path)
        style = self.reasoning_parser
        if style == "auto":
            style = template_style(chat_template(tok))
        return ollama_show(e.spec.name, path, info, tok, style is not None)

    def ollama_entry(self, e: ModelEntry, loaded: bool) -> dict[str, Any]:
        from tandem.frontend.http.ollama_models import ollama_model_entry

        found = self.model_info(e)
        path, info = found if found else (e.spec.model, None)
        expires = None
        if loaded:
            t = e.expires_at
            # ollama shows a far date for "never"; its clients parse a timestamp either way
            secs = (t - time.monotonic()) if t is not None else 10 * 365 * 86400.0
            expires = datetime.fromtimestamp(time.time() + secs, timezone.utc).isoformat().replace(
                "+00:00", "Z")
        return ollama_model_entry(e.spec.name, path, info, expires)

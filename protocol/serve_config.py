"""`tandem serve`'s HTTP options: one frozen dataclass; the CLI flags derive from it.

It crosses to the HTTP process msgspec-encoded (never pickled).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tandem.protocol.choices import ReasoningParserName, check_choices
from tandem.protocol.model_spec import parse_keep_alive


@dataclass(frozen=True)
class ServeConfig:
    http: bool = field(default=True, metadata={"help": "serve the OpenAI-compatible HTTP API"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "HTTP port (0: any free port)"})
    api_key: str | None = field(default=None, metadata={"help": "require 'Authorization: Bearer KEY'"})
    admin_api_key: str | None = field(
        default=None,
        metadata={
            "help": "serve the operator routes (POST /drain) behind 'Authorization: Bearer KEY', a key "
            "other than --api-key's; without it they are not served (404). SIGTERM drains either way"
        },
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name clients send; default: the model directory's name"}
    )
    max_concurrent_requests: int = field(
        default=512,
        metadata={
            "help": "generation and embedding requests served at once (a stream until it is "
            "written out); past it 503 overloaded"
        },
    )
    reasoning_parser: ReasoningParserName | None = field(default=None, metadata={
        "help": "split the model's thinking into reasoning_content: qwen3, deepseek-r1, or auto (from the "
                "chat template's think markers; none when it has none)"})
    response_store: int = field(default=256, metadata={
        "help": "Responses API: how many responses are kept for previous_response_id (oldest dropped first)"})
    # Several models (--model given more than once, or --models-file): each loads on its first request.
    models_file: str | None = field(default=None, metadata={
        "help": "a TOML file of [[model]] tables (name, model, options, keep_alive, pinned): serve them all, "
                "each loaded on its first request"})
    keep_alive: str = field(default="5m", metadata={
        "help": "with several models: how long a model stays loaded once idle (30s, 5m, 1h, seconds; "
                "0 unloads at once, -1 never); a request's keep_alive (ollama's) overrides it"})
    max_loaded_models: int = field(default=3, metadata={
        "help": "with several models: how many are loaded at once; loading another unloads the least "
                "recently used idle one"})
    max_loaded_memory_gb: float | None = field(default=None, metadata={
        "help": "with several models: the loaded models' weights (their size on disk) stay under this; "
                "loading another unloads idle ones as --max-loaded-models does"})
    # Images (vision-language models): where an image_url may point besides a data: URL, and how many.
    allowed_media_domains: list[str] = field(default_factory=list, metadata={
        "help": "image URLs over http(s) may be fetched from these hosts (none by default: data: URLs "
                "and base64 only)"})
    allowed_local_media_path: str | None = field(default=None, metadata={
        "help": "image URLs may name files (file:// or a path) under this directory (none by default)"})
    limit_mm_per_prompt: int = field(default=8, metadata={"help": "images one prompt may hold"})
    max_image_pixels: int = field(default=40_000_000, metadata={
        "help": "an image larger than this many pixels (decoded) is refused"})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"invalid serve option port={self.port}: must be in [0, 65535]")
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"invalid serve option max_concurrent_requests={self.max_concurrent_requests}: must be >= 1"
            )
        if self.api_key == "":
            raise ValueError("invalid serve option api_key='': give a key or leave the option out")
        if self.admin_api_key == "":
            raise ValueError("invalid serve option admin_api_key='': give a key or leave the option out")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError(
                "invalid serve option admin_api_key: must differ from api_key (the inference key "
                "must not reach the operator routes)"
            )
        check_choices(type(self), vars(self), "serve")
        if self.max_loaded_models < 1:
            raise ValueError(f"invalid serve option max_loaded_models={self.max_loaded_models}: must be >= 1")
        parse_keep_alive(self.keep_alive)  # ValueError names it
        if self.max_loaded_memory_gb is not None and not self.max_loaded_memory_gb > 0:
            raise ValueError(f"invalid serve option max_loaded_memory_gb={self.max_loaded_memory_gb}: "
                             "must be > 0")
        if self.limit_mm_per_prompt < 0 or self.max_image_pixels < 1:
            raise ValueError("invalid serve option: limit_mm_per_prompt must be >= 0, max_image_pixels >= 1")
        if self.response_store < 0:
            raise ValueError(f"invalid serve option response_store={self.response_store}: must be >= 0")

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ServeConfig:
        return msgspec.json.decode(data, type=cls)

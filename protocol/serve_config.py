"""`tandem serve`'s HTTP options: one frozen dataclass; the CLI flags derive from it.

It crosses to the HTTP process msgspec-encoded (never pickled).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from tandem.protocol.choices import ReasoningParserName, check_choices


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
        if self.response_store < 0:
            raise ValueError(f"invalid serve option response_store={self.response_store}: must be >= 0")

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ServeConfig:
        return msgspec.json.decode(data, type=cls)

"""What `Client.embed` hands back: the pooled vector of one input, with how the request ended (the engine's
`final` record: prompt_tokens, metrics ...)."""
from __future__ import annotations

import base64
from array import array
from dataclasses import dataclass

from tandem.protocol.final_info import FinalInfo, HasFinal
from tandem.protocol.messages import EmbeddingOutput, EngineLoad


@dataclass
class Embedding(HasFinal):
    request_id: str
    data: bytes  # float32, little-endian: the wire form (and OpenAI's base64 one, decoded)
    final: FinalInfo | None = None
    load: EngineLoad | None = None  # the engine's gauges when it left the scheduler

    @classmethod
    def of(cls, out: EmbeddingOutput) -> Embedding:
        return cls(out.rid, out.embedding, out.final, out.load)

    @property
    def embedding(self) -> list[float]:
        v = array("f")
        v.frombytes(self.data)
        return v.tolist()

    @property
    def dimensions(self) -> int:
        return len(self.data) // 4

    def base64(self) -> str:
        return base64.b64encode(self.data).decode("ascii")

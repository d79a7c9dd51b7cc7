"""Messages, codec, socket helpers and configuration shared by every tandem process."""
from protocol.embed_params import EmbedParams
from protocol.errors import (
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
    TandemError,
)
from protocol.sampling_params import SamplingParams

__all__ = [
    "SamplingParams", "EmbedParams", "TandemError", "InvalidRequestError", "RequestFailedError", "OverloadedError", "EngineDeadError",
]

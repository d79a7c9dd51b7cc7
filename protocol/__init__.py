"""Messages, codec, socket helpers and configuration shared by every tandem process."""
from protocol.errors import (
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
    TandemError,
)
from protocol.sampling_params import SamplingParams

__all__ = [
    "SamplingParams", "TandemError", "InvalidRequestError", "RequestFailedError", "OverloadedError", "EngineDeadError",
]

"""tandem: an LLM inference engine. The public API is this one import:

    from tandem import Client, AsyncClient, SamplingParams, EmbedParams

The engine's folders (frontend/, scheduler/, worker/, detokenizer/, protocol/, kernels/, launch/,
benchmarks/) sit at the repository's top level and are installed as `tandem.<folder>`: no top-level name
but `tandem` is ever imported, so none can shadow another distribution (Hugging Face's `kernels`, which
transformers imports, is one)."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

# In a source checkout the folders are this package's siblings; in an installed wheel they are inside it.
_HERE = Path(__file__).resolve().parent
if not (_HERE / "scheduler").is_dir() and (_HERE.parent / "scheduler" / "req.py").is_file():
    __path__.append(str(_HERE.parent))

# Names are resolved on first use, so `import tandem.kernels.ops` in a worker does not load the client.
_PUBLIC = {
    "Client": "tandem.frontend.client",
    "AsyncClient": "tandem.frontend.client",
    "Completion": "tandem.frontend.completion",
    "CompletionDelta": "tandem.frontend.completion",
    "Embedding": "tandem.frontend.embedding",
    "SamplingParams": "tandem.protocol.sampling_params",
    "EmbedParams": "tandem.protocol.embed_params",
    "TandemError": "tandem.protocol.errors",
    "InvalidRequestError": "tandem.protocol.errors",
    "RequestFailedError": "tandem.protocol.errors",
    "OverloadedError": "tandem.protocol.errors",
    "EngineDeadError": "tandem.protocol.errors",
}
__all__ = [
    "Client", "AsyncClient", "Completion", "CompletionDelta", "Embedding", "SamplingParams", "EmbedParams",
    "TandemError", "InvalidRequestError", "RequestFailedError", "OverloadedError", "EngineDeadError",
]
assert set(__all__) == set(_PUBLIC)

if TYPE_CHECKING:
    from tandem.frontend.client import AsyncClient, Client
    from tandem.frontend.completion import Completion, CompletionDelta
    from tandem.frontend.embedding import Embedding
    from tandem.protocol.embed_params import EmbedParams
    from tandem.protocol.errors import (
        EngineDeadError,
        InvalidRequestError,
        OverloadedError,
        RequestFailedError,
        TandemError,
    )
    from tandem.protocol.sampling_params import SamplingParams


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

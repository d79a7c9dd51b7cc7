"""The frontend: three doors into the engine, each in its room. client/ (the Python clients), server/ (the
frontend process: tokenize, validate, route) and http/ (the OpenAI-compatible server)."""
from frontend.client import AsyncClient, Client
from frontend.completion import Completion, CompletionDelta
from frontend.embedding import Embedding

__all__ = ["Client", "AsyncClient", "Completion", "CompletionDelta", "Embedding"]

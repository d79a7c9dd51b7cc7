"""The frontend: the frontend process (tokenize, validate, route) and the Python clients."""
from frontend.client.async_client import AsyncClient
from frontend.client.client import Client
from frontend.completion import Completion, CompletionDelta

__all__ = ["Client", "AsyncClient", "Completion", "CompletionDelta"]

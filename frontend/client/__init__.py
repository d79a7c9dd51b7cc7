"""The client library: AsyncClient (the one implementation), Client (its sync shell), the engine a client
owns."""

from tandem.frontend.client.async_client import AsyncClient
from tandem.frontend.client.client import Client

__all__ = ["Client", "AsyncClient"]

"""A session as the Python clients see it (`Client.open_session`, `AsyncClient.open_session`): requests
through it continue a turn's full context (by default the latest turn; `branch_from` names an earlier
one by its request id), and closing it (or leaving its `with` block) hands its KV back to the engine.

A continuation's prompt is appended to the turn's tokens as given: send the new turn's token ids (or text
whose tokenization, special tokens included, is what should follow)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from tandem.frontend.client.request_encoding import Params, Prompt
from tandem.frontend.completion import Completion, CompletionDelta
from tandem.protocol.messages import SessionParams

if TYPE_CHECKING:
    from tandem.frontend.client.async_client import AsyncClient
    from tandem.frontend.client.client import Client


class AsyncSession:
    def __init__(self, client: AsyncClient, session_id: str) -> None:
        self.client, self.id = client, session_id

    async def generate(self, prompt: Prompt, params: Params = None, request_id: str | None = None, *,
                       branch_from: str | None = None, priority: int = 0) -> Completion:
        return await self.client.generate(prompt, params, request_id, priority=priority,
                                          session=SessionParams(self.id, branch_from))

    def stream(self, prompt: Prompt, params: Params = None, request_id: str | None = None, *,
               branch_from: str | None = None, priority: int = 0) -> AsyncIterator[CompletionDelta]:
        return self.client.stream(prompt, params, request_id, priority=priority,
                                  session=SessionParams(self.id, branch_from))

    async def close(self) -> None:
        await self.client.close_session(self.id)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Session:
    """The synchronous twin, over Client."""

    def __init__(self, client: Client, session_id: str) -> None:
        self.client, self.id = client, session_id

    def generate(self, prompt: Prompt, params: Params = None, request_id: str | None = None, *,
                 branch_from: str | None = None, priority: int = 0) -> Completion:
        return self.client.generate(prompt, params, request_id, priority=priority,
                                    session=SessionParams(self.id, branch_from))

    def stream(self, prompt: Prompt, params: Params = None, request_id: str | None = None, *,
               branch_from: str | None = None, priority: int = 0) -> Iterator[CompletionDelta]:
        return self.client.stream(prompt, params, request_id, priority=priority,
                                  session=SessionParams(self.id, branch_from))

    def close(self) -> None:
        self.client.close_session(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

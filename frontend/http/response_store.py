"""The Responses API's memory: finished responses by id, for `previous_response_id`, bounded.

What is kept per response is the conversation that produced it (its input, without the instructions,
which OpenAI does not carry over) plus its output as chat messages, and the response body itself. Past
`capacity` the least recently used one is dropped; asking for it then is a 404, as for an id never seen.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandem.frontend.http.schemas import ChatMessageBody

DEFAULT_CAPACITY = 256


@dataclass
class StoredResponse:
    messages: list[ChatMessageBody]  # input and output of the turn, ready for the chat template
    body: dict


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def __len__(self) -> int:
        return len(self._items)

"""The client's LoRA adapter calls: load one while serving, unload one (AsyncClient has them)."""
from __future__ import annotations

from typing import Any

from tandem.frontend.client.request_encoding import new_rid
from tandem.protocol.lora_messages import MAX_UNLOAD_WAIT_S, LoadLora, LoraReply, UnloadLora

REPLY_MARGIN_S = 30.0  # past an unload's own wait, what its reply may take to come


class AdapterCalls:
    _query: Any  # AsyncClient's: a call the scheduler answers, its reply or its typed error raised

    async def load_lora(self, name: str, path: str) -> int:
        """Serve the PEFT adapter directory or llama.cpp LoRA file at `path` (on the engine's machine) as
        `name`; requests pick it with lora=name. Returns its generation (a reload under the same name is a
        new one, its KV its own).
        InvalidRequestError: the adapter cannot be served (code invalid_request.lora, its field named) or the
        name is taken (invalid_request.lora_conflict); the engine serves on either way."""
        rid = new_rid()
        reply = await self._query(rid, LoadLora(rid, name, str(path)))
        assert isinstance(reply, LoraReply)
        return reply.generation

    async def unload_lora(self, name: str, *, abort_running: bool = False, timeout_s: float = 30.0) -> None:
        """Stop serving `name`: at once for new requests; its requests still running are waited for up to
        timeout_s (then RequestFailedError lora_busy, and it stays served), or with abort_running they fail
        now (request_failed.lora_unloaded)."""
        if not 0 <= timeout_s <= MAX_UNLOAD_WAIT_S:
            raise ValueError(f"timeout_s must be in [0, {MAX_UNLOAD_WAIT_S}]")
        rid = new_rid()
        await self._query(rid, UnloadLora(rid, name, abort_running, timeout_s), timeout_s + REPLY_MARGIN_S)

"""The messages of LoRA adapters loaded and unloaded while serving (client -> frontend -> scheduler, the
reply back through the detokenizer as a session call's), and the worker's orders to fill a device slot."""
from __future__ import annotations

import msgspec

MAX_UNLOAD_WAIT_S = 3600.0


class LoadLora(msgspec.Struct, tag="load_lora"):
    """Serve the PEFT adapter at `path` as `name`; answered with LoraReply or RequestError (a bad adapter:
    invalid_request.lora naming its field; a name taken: invalid_request.lora_conflict). rid names this
    call only."""

    rid: str
    name: str
    path: str


class UnloadLora(msgspec.Struct, tag="unload_lora"):
    """Stop serving `name`. Its requests still running are waited for, up to timeout_s (then the unload
    fails and the adapter stays), or with abort_running they fail now (request_failed.lora_unloaded)."""

    rid: str
    name: str
    abort_running: bool = False
    timeout_s: float = 30.0


class LoraReply(msgspec.Struct, tag="lora"):
    rid: str  # of the LoadLora / UnloadLora call
    name: str
    loaded: bool  # True: now served; False: unloaded
    generation: int  # the adapter's load under this name (a reload is a new one: its KV is its own)


class LoraSlotLoad(msgspec.Struct, array_like=True):
    """Worker: put adapter `name` (its load `generation`, from `path`) into device slot `slot`."""

    slot: int
    name: str
    generation: int
    path: str

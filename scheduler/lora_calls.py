"""The scheduler's answers to LoadLora and UnloadLora (scheduler/lora_adapters.py keeps the table)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.protocol.errors import ErrorCode, InvalidRequestError, ModelLoadError
from tandem.protocol.lora_messages import LoadLora, LoraReply, UnloadLora
from tandem.protocol.messages import RequestError
from tandem.scheduler.lora_adapters import NO_LORA

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


def load_lora(sched: Scheduler, msg: LoadLora) -> LoraReply | RequestError:
    if sched.lora is None:
        return RequestError(msg.rid, ErrorCode.LORA, NO_LORA)
    try:
        a = sched.lora.register(msg.name, msg.path)
    except InvalidRequestError as e:
        return RequestError(msg.rid, e.code, e.message)
    except ModelLoadError as e:  # LoraError: the field that is wrong, in its message
        return RequestError(msg.rid, ErrorCode.LORA, str(e))
    return LoraReply(msg.rid, a.name, True, a.generation)


def unload_lora(sched: Scheduler, msg: UnloadLora) -> LoraReply | RequestError | None:
    """The reply now, or None: it comes (in the scheduler's outbox) once the adapter's requests are gone."""
    if sched.lora is None:
        return RequestError(msg.rid, ErrorCode.LORA, NO_LORA)
    try:
        doomed = sched.lora.unload(msg, list(sched.reqs.values()))
    except InvalidRequestError as e:
        return RequestError(msg.rid, e.code, e.message)
    for req in doomed:
        sched.fail(req, ErrorCode.LORA_UNLOADED, f"its adapter {msg.name!r} was unloaded")
    replies = sched.lora.settle(sched.reqs.values())
    sched.outbox.extend(r for r in replies if r.rid != msg.rid)
    return next((r for r in replies if r.rid == msg.rid), None)


def settle_loras(sched: Scheduler) -> None:
    """Unloads that end now answer their callers."""
    if sched.lora is not None and sched.lora.unloading:
        sched.outbox.extend(sched.lora.settle(sched.reqs.values()))

"""What refuses a request as it arrives, before it is queued: each refusal is the request's typed error."""
from __future__ import annotations

from tandem.protocol.errors import ErrorCode
from tandem.protocol.messages import RequestError, TokenizedRequest
from tandem.scheduler.sessions import Turn


def refusal(msg: TokenizedRequest, ids: list[int], room: int, kv_size: int, max_waiting: int | None,
            waiting: int, turn: Turn | None) -> RequestError | None:
    """ids: its prompt (a session turn's context included); room: the context left after it; waiting: the
    requests waiting now (queued or compiling a grammar); turn: the session turn it continues."""
    n = len(ids)
    if n == 0 or room < (0 if msg.embed else 1):  # an embedding needs no room for an output
        return RequestError(msg.rid, ErrorCode.PROMPT_TOO_LONG, f"prompt has {n} tokens")
    if n + 1 > kv_size:
        return RequestError(msg.rid, ErrorCode.KV_CAPACITY,
                            f"prompt of {n} tokens can never fit the KV pool of {kv_size}")
    if max_waiting is not None and waiting >= max_waiting:
        return RequestError(msg.rid, ErrorCode.OVERLOADED, f"{max_waiting} requests are waiting already")
    if turn is not None and turn.lora != msg.lora:  # its KV is taken as it is: never under another adapter
        return RequestError(msg.rid, ErrorCode.SESSION_TURN, f"the turn it continues ran under adapter "
                            f"{turn.lora!r}, this request under {msg.lora!r}: a session keeps one adapter")
    return None

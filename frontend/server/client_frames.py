"""One guard for everything a client socket delivers: frames in, a message or a reason to drop them.

Any local process can write to the client socket, so nothing here may raise: undecodable bytes, a wrong
frame count, an unknown tag, an oversized frame or a bad request id become a `BadFrames`, answered with a
typed error when its sender and request id can be told (and only logged otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tandem.protocol.codec import Decoder, client_decoder
from tandem.protocol.errors import ErrorCode
from tandem.protocol.messages import ClientMsg

MAX_RID_LEN = 256


class _RidOnly(msgspec.Struct):
    """Enough of any client message to name the request it was about."""

    rid: str


_peek = msgspec.msgpack.Decoder(_RidOnly)


@dataclass(frozen=True)
class BadFrames:
    ident: bytes | None  # the sender (ROUTER identity), when there was one
    rid: str | None  # the request it was about, when that could be read
    code: ErrorCode
    message: str

    @property
    def answerable(self) -> bool:
        return self.ident is not None and self.rid is not None


def peek_rid(data: bytes) -> str | None:
    try:
        rid = _peek.decode(data).rid
    except msgspec.DecodeError:
        return None
    return rid if 0 < len(rid) <= MAX_RID_LEN else None


class ClientFrames:
    def __init__(self, max_request_bytes: int, decode: Decoder[ClientMsg] | None = None) -> None:
        self.max_request_bytes = max_request_bytes
        self._decode = decode or client_decoder()

    def parse(self, frames: list[bytes]) -> tuple[bytes, ClientMsg] | BadFrames:
        """ROUTER frames [identity, message] into the sender and its message."""
        if len(frames) != 2:
            ident = frames[0] if frames else None
            return BadFrames(
                ident, None, ErrorCode.MALFORMED, f"expected 1 message frame, got {len(frames) - 1}"
            )
        ident, data = frames
        if len(data) > self.max_request_bytes:
            return BadFrames(
                ident, peek_rid(data), ErrorCode.TOO_LARGE,
                f"request of {len(data)} bytes is over the limit of {self.max_request_bytes}",
            )
        try:
            msg = self._decode(data)
        except msgspec.DecodeError as e:  # also ValidationError: a known encoding of an unknown shape or tag
            return BadFrames(ident, peek_rid(data), ErrorCode.MALFORMED, f"undecodable request: {e}")
        if not 0 < len(msg.rid) <= MAX_RID_LEN:
            return BadFrames(
                ident, None, ErrorCode.BAD_RID, f"request id must be 1..{MAX_RID_LEN} characters"
            )
        return ident, msg

"""The one codec: msgpack via msgspec, one typed decoder per socket union. No pickle anywhere."""
from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from tandem.protocol import messages as m

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class Decoder(Generic[T]):
    """Decodes one socket's tagged union.

    Raises msgspec.DecodeError for bytes that are not msgpack (empty, truncated, garbage), and its subclass
    msgspec.ValidationError for msgpack of the wrong shape (an unknown tag, a missing field, a wrong type).
    Catch DecodeError to cover both; a socket that any local process can write to must (see the frontend).
    """

    def __init__(self, union: Any) -> None:
        self._dec = msgspec.msgpack.Decoder(union)

    def __call__(self, data: bytes) -> T:
        return self._dec.decode(data)


def client_decoder() -> Decoder[m.ClientMsg]:
    return Decoder(m.ClientMsg)


def frontend_decoder() -> Decoder[m.FrontendMsg]:
    return Decoder(m.FrontendMsg)


def scheduler_in_decoder() -> Decoder[m.SchedulerInMsg]:
    return Decoder(m.SchedulerInMsg)


def worker_in_decoder() -> Decoder[m.WorkerInMsg]:
    return Decoder(m.WorkerInMsg)


def worker_out_decoder() -> Decoder[m.WorkerMsg]:
    return Decoder(m.WorkerMsg)


def detok_in_decoder() -> Decoder[m.DetokInMsg]:
    return Decoder(m.DetokInMsg)


def frontend_in_decoder() -> Decoder[m.FrontendInMsg]:
    return Decoder(m.FrontendInMsg)


def launcher_decoder() -> Decoder[m.LauncherMsg]:
    return Decoder(m.LauncherMsg)

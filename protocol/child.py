"""What every engine process does first: follow its parent, decode its config, report how startup went."""
from __future__ import annotations

import signal
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from tandem.protocol.codec import encode
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.ipc import Endpoints, exit_with_parent, make_socket
from tandem.protocol.messages import Failed


def start_child(cfg_bytes: bytes, ep_bytes: bytes) -> tuple[EngineConfig, Endpoints, zmq.Context, zmq.Socket]:
    """Config, endpoints, a ZMQ context and the socket to the launcher's readiness handshake."""
    exit_with_parent()
    # A terminal's Ctrl-C reaches the whole process group: the launcher alone acts on it (a drain), and
    # stops the children when the drain is done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = EngineConfig.decode(cfg_bytes)
    ep = Endpoints.decode(ep_bytes)
    ctx = zmq.Context()
    return cfg, ep, ctx, make_socket(ctx, zmq.PUSH, ep.launcher, bind=False)


@contextmanager
def reporting_startup(launcher: zmq.Socket, role: str) -> Iterator[None]:
    """Any startup failure goes to the launcher with its traceback (so `serve` can say why), then exit."""
    try:
        yield
    except Exception as e:  # whatever broke, the launcher must hear of it
        # A model the engine cannot load is the user's to fix: the message says it all, no traceback.
        detail = str(e) if isinstance(e, ModelLoadError) else f"{e}\n{traceback.format_exc()}"
        launcher.send(encode(Failed(role, detail)))
        raise SystemExit(1) from e

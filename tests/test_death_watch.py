"""frontend/client/connection.py's DeathWatch on real ZMQ monitor events: a client that connects before the
frontend binds (the HTTP process starts beside the engine's processes) sees CLOSED events for the attempts
that found nobody listening; those are not the engine's death. Once connected, losing the peer is."""
from __future__ import annotations

import time

import zmq

from tandem.frontend.client.connection import DeathWatch, open_dealer


def _events(monitor: zmq.Socket, watch: DeathWatch, wait_s: float) -> list[bool]:
    out = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if monitor.poll(50):
            out.append(watch.is_dead(monitor.recv_multipart()))
    return out


def test_attempts_before_the_bind_are_not_death_and_a_lost_peer_is(tmp_path) -> None:
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/frontend"
    sock, monitor = open_dealer(ctx, endpoint)
    watch = DeathWatch(endpoint)
    try:
        early = _events(monitor, watch, 0.6)  # nobody listens: each retried attempt ends in CLOSED
        assert early and not any(early) and not watch.connected
        frontend = ctx.socket(zmq.ROUTER)
        frontend.bind(endpoint)
        sock.send(b"hello")
        assert frontend.poll(5000) and frontend.recv_multipart()[1] == b"hello"
        assert not any(_events(monitor, watch, 0.3)) and watch.connected
        frontend.close(0)  # the frontend's end goes away
        assert any(_events(monitor, watch, 2.0))
    finally:
        sock.close(0)
        monitor.close(0)
        ctx.term()

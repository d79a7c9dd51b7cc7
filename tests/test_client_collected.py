"""A client dropped without close() (a caller who forgot, a test that failed half way) is cleaned up by the
garbage collector without hanging it: its I/O thread stops, and its sockets and context are closed by the
client, never left to the collector (which deadlocks on a context collected in one cycle with its
sockets). Run in a child process: a deadlocked collection there is a timeout here, not a hung suite."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import gc, sys, threading, time, weakref
    import zmq
    from tandem import Client
    from tandem import EngineDeadError, SamplingParams

    ctx = zmq.Context()
    frontend = ctx.socket(zmq.ROUTER)
    frontend.setsockopt(zmq.LINGER, 0)
    endpoint = "ipc://" + sys.argv[1]
    frontend.bind(endpoint)
    client = Client(endpoint)
    errors = []

    def stream():
        try:
            list(client.stream([1, 2, 3], SamplingParams(max_tokens=4)))
        except EngineDeadError as e:
            errors.append(str(e))  # not the exception: its traceback would keep the client

    t = threading.Thread(target=stream)
    t.start()
    assert frontend.poll(10_000), "the request never came"
    frontend.recv_multipart()
    frontend.close(0)  # the engine's end goes away while the call waits
    t.join(30)
    assert errors, "the waiting call got no error"
    async_client = weakref.ref(client._async)
    del client, t
    gc.collect()
    deadline = time.monotonic() + 10
    while any(th.name == "tandem-client-io" for th in threading.enumerate()):
        assert time.monotonic() < deadline, "the dropped client's thread still runs"
        time.sleep(0.05)
    gc.collect()
    assert async_client() is None, "the dropped client was never collected"
    ctx.term()
    print("collected")
""")


def test_a_dropped_client_is_collected_without_a_hang(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "frontend")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert r.returncode == 0 and r.stdout.strip() == "collected", r.stderr

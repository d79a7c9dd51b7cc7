"""No orphans, ever: an engine started by Client.launch stops when its owner dies, however it dies, and
every engine process stops when the launcher is SIGKILLed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from tests.test_lifecycle import _children, _serve, _wait_gone, assert_left_last

_OWNER = """
import sys, threading, time
from tandem import Client

box = {}
# Launched from a thread that ends at once: the engine must follow the owner process, not that thread.
t = threading.Thread(target=lambda: box.setdefault("c", Client.launch(sys.argv[1], kv_cache_tokens=1024)))
t.start()
t.join()
print("served", box["c"].generate([1, 2, 3], {"max_tokens": 2}).completion_tokens, flush=True)
time.sleep(600)
"""


def test_engine_exits_when_its_owner_is_sigkilled(tiny_model) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tiny_model("llama"))], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "served 2"
        engine = _children(owner.pid)
        names = {" ".join(p.cmdline()) for p in engine}
        assert len(engine) >= 5 and any("serve" in n for n in names)  # tandem serve + its 4 processes
        owner.kill()
        owner.wait(10)
        assert _wait_gone(engine, timeout=30) == [], "engine processes outlived their owner"
    finally:
        if owner.poll() is None:
            owner.kill()


def test_every_engine_process_exits_when_the_launcher_is_sigkilled(tiny_model) -> None:
    proc, _, pids = _serve(tiny_model("llama"))
    kids = _children(proc.pid)
    assert {psutil.Process(pid).pid for pid in pids.values()} <= {k.pid for k in kids}
    proc.kill()
    proc.wait(10)
    assert _wait_gone(kids, timeout=30) == [], "orphaned engine processes"


def test_an_owner_gone_from_both_pipes_still_stops_everything_on_sigterm(tiny_model) -> None:
    """A program that started `tandem serve` with its output piped, then died (its pipes closed), then a
    SIGTERM: the drain's line to stderr meets a closed pipe. That must not end the supervision before the
    children are stopped (the interpreter's exit then waited on them forever): the server exits, nothing is
    left."""
    proc, _, _ = _serve(tiny_model("llama"))
    kids = _children(proc.pid)
    proc.stdout.close()
    proc.stderr.close()  # writes to either pipe now fail with EPIPE
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("tandem serve did not exit after SIGTERM with its output pipes closed") from None
    assert_left_last(proc, kids)

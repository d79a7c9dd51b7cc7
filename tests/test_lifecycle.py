"""Start, stop and death: no orphan process, waiting clients get an error, the launcher exits non-zero."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tandem import Client, EngineDeadError, SamplingParams
from tandem.protocol import fault_injection
from tandem.protocol.serve_announcements import PROCESS_PREFIX, READY_PREFIX
from tandem.worker.heap_keeper import HeapKeeper

FATAL_MARK = 993


def _serve(
    model, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str, dict[str, int]]:
    pids: dict[str, int] = {}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.launch.cli",
            "serve",
            "--model",
            str(model),
            "--kv-cache-tokens",
            "4096",
            "--no-http",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(PROCESS_PREFIX):
            name, pid = line[len(PROCESS_PREFIX):].split()
            pids[name] = int(pid)
        if line.startswith(READY_PREFIX):
            return proc, line[len(READY_PREFIX):].strip(), pids
    raise AssertionError(f"engine did not start: {proc.stderr.read() if proc.stderr else ''}")


def _children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _wait_gone(procs: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def start_long_stream(client: Client, max_tokens: int) -> tuple[threading.Thread, list[BaseException]]:
    """A thread streaming a long request, returned once its first token came; what the stream raised (the
    tests inspect it) lands in the list."""
    errors: list[BaseException] = []
    started = threading.Event()

    def wait_on_long_request() -> None:
        try:
            for _ in client.stream([5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True)):
                started.set()
        except BaseException as e:  # the test inspects it
            errors.append(e)
        started.set()

    t = threading.Thread(target=wait_on_long_request)
    t.start()
    assert started.wait(60)
    return t, errors


def assert_left_last(proc: subprocess.Popen, kids: list[psutil.Process]) -> None:
    """The launcher has exited: not one of its descendants may still exist, not even as a zombie, at once
    (a supervisor restarting it must not race a child holding the port or the socket directory)."""
    assert proc.poll() is not None
    left = [k for k in kids if k.is_running()]
    assert left == [], [(k.pid, k.info) for k in psutil.process_iter(["status", "cmdline"]) if k in left]


def test_sigterm_stops_everything_with_no_orphans(tiny_model) -> None:
    # --drain-timeout-s 0: no drain (tests/test_drain.py has those), the running call is ended at once.
    proc, endpoint, pids = _serve(tiny_model("llama"), "--drain-timeout-s", "0")
    kids = _children(proc.pid)
    assert {"tandem-worker0", "tandem-scheduler", "tandem-detokenizer", "tandem-frontend"} <= set(pids)
    assert len(kids) >= 4  # worker, scheduler, detokenizer, frontend
    # multiprocessing's resource tracker is one of them, and it must leave before the launcher too.
    assert any("resource_tracker" in " ".join(k.cmdline()) for k in kids), [k.cmdline() for k in kids]
    with Client(endpoint) as c:
        assert c.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)).completion_tokens == 4
        stream = c.stream([5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True))
        next(stream)
        proc.send_signal(signal.SIGTERM)
        # The waiting call hears why, from the frontend on its way down: not a generic lost connection.
        with pytest.raises(EngineDeadError, match=r"stopped \(SIGTERM\)"):
            list(stream)
    assert proc.wait(15) == 0
    assert_left_last(proc, kids)


def assert_killing_stops_engine(model, victim: str, *flags: str) -> None:
    """Kill one engine process while a client waits: the client gets EngineDeadError within seconds, naming
    the killed process (not a peer's echo of its death), the launcher exits non-zero, and no process is left
    behind."""
    proc, endpoint, pids = _serve(model, *flags)
    kids = _children(proc.pid)
    with Client(endpoint) as client:
        t, errors = start_long_stream(client, 2000)
        psutil.Process(pids[victim]).kill()
        t.join(60)  # a hang guard, not a latency figure: the typed error below is what is asserted
        assert not t.is_alive(), "client still waiting after a process died"
    assert errors and isinstance(errors[0], EngineDeadError), errors
    assert "lost the connection" not in str(errors[0]), "the typed reason was dropped on the way down"
    assert f"{victim} (pid {pids[victim]}) exited with code -9 (SIGKILL)" in str(errors[0]), errors[0]
    assert proc.wait(20) != 0
    assert_left_last(proc, kids)


def test_a_fatal_worker_fault_reaches_every_waiting_client(tiny_model) -> None:
    """The worker's loop raises (an injected fault no step survives): the waiting calls and the one that
    caused it get EngineDeadError naming the worker's exception, the launcher exits non-zero, nothing left."""
    proc, endpoint, _ = _serve(tiny_model("llama"), env={fault_injection.ENV: f"worker.fatal:{FATAL_MARK}"})
    kids = _children(proc.pid)
    with Client(endpoint) as client:
        t, errors = start_long_stream(client, 2000)
        with pytest.raises(EngineDeadError) as e:
            client.generate([5, FATAL_MARK, 6], SamplingParams(max_tokens=4))
        t.join(60)
        assert not t.is_alive(), "client still waiting after the worker failed"
    why = "worker 0 failed: InjectedFault: injected fault at worker.fatal"
    assert why in str(e.value), e.value
    assert errors and isinstance(errors[0], EngineDeadError) and why in str(errors[0]), errors
    assert proc.wait(20) != 0
    assert_left_last(proc, kids)


def test_killing_the_worker_fails_waiting_clients_and_launcher_exits_nonzero(tiny_model) -> None:
    assert_killing_stops_engine(tiny_model("llama"), "tandem-worker0")


def test_unknown_engine_option_is_an_error(tiny_model) -> None:
    with pytest.raises(TypeError, match="unknown engine option"):
        Client.launch(str(tiny_model("llama")), kv_cache_tokenz=100)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.launch.cli",
            "serve",
            "--model",
            str(tiny_model("llama")),
            "--no-such-flag",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "unrecognized arguments" in r.stderr


def test_engine_option_of_the_wrong_type_is_an_error_and_a_good_one_serves(tiny_model) -> None:
    model = str(tiny_model("llama"))
    for bad in ({"enforce_eager": "yes"}, {"max_running_requests": True}, {"kv_memory_fraction": "0.2"},
                {"cpu_int8_activations": "yes"}, {"heap_trim_period_s": "30"}):
        with pytest.raises(ValueError, match=f"invalid engine option.*{next(iter(bad))}"):
            Client.launch(model, **bad)
    for field, value in (("kv_memory_fraction", 2.0), ("kv_cache_dtype", "fp8"), ("heap_trim_period_s", -1.0),
                         ("heap_trim_period_s", float("nan"))):  # values __post_init__ refuses
        with pytest.raises(ValueError, match=field):
            Client.launch(model, **{field: value})
    # A directory model on CPU has no decode graph to turn off; the options all reach a serving engine.
    with Client.launch(model, enforce_eager=True, kv_cache_tokens=2048, kv_cache_dtype="float16",
                       cpu_int8_activations=False, heap_trim_period_s=0.05) as client:
        out = client.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out.token_ids) == 4
        if HeapKeeper(1.0).available:  # past its period the worker trims and its sample reaches the stats
            time.sleep(0.1)
            client.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            heap = client.stats().worker_heap
            assert heap is not None and heap.trims >= 1 and heap.in_use > 0 and heap.rss > 0

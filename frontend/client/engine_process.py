"""An engine owned by a client: the `tandem serve` program as a child process, stopped with the client.

The child gets one end of a socket pair as `--owner-fd`: it writes its `Ready` record there once clients
can connect, and stops when the other end closes, which the kernel does when this process dies, however it
dies (PR_SET_PDEATHSIG alone would follow the calling thread).
"""
from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
from collections import deque

from tandem.protocol.codec import launcher_decoder
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import Ready
from tandem.protocol.mmproj import projector_model_dir
from tandem.protocol.model_fit import check_model_fits
from tandem.protocol.serve_announcements import read_until_http

READY_MARGIN_S = 30.0  # past the child's own startup timeout: its imports and its launcher's teardown
_owners: dict[int, socket.socket] = {}  # engine pid -> our end of its owner socket, held while we own it


def config_to_argv(cfg: EngineConfig) -> list[str]:
    """The `tandem serve` flags (see launch/cli_options.py) that rebuild this config."""
    argv: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        v, flag = getattr(cfg, f.name), f.name.replace("_", "-")
        if isinstance(v, bool):
            argv.append(f"--{flag}" if v else f"--no-{flag}")
        elif isinstance(v, list):
            argv += [a for item in v for a in (f"--{flag}", str(item))]
        elif v is not None:
            argv += [f"--{flag}", str(v)]
    return argv


def start_engine_process(model: str, **options: object) -> tuple[subprocess.Popen, str]:
    """The engine without HTTP (the client talks ZMQ); returns (process, ZMQ endpoint)."""
    cfg = EngineConfig.from_options(model, **options)  # unknown options fail here, in the caller
    check_model_fits(cfg)  # so does a configuration the model cannot run (ConfigError), before any spawn
    # No HTTP server: it would also contend for the default port.
    proc, endpoint, _ = _spawn(cfg, ["--no-http"])
    return proc, endpoint


def start_served_process(cfg: EngineConfig, serve_argv: list[str]) -> tuple[subprocess.Popen, str]:
    """`tandem serve` with its HTTP server (SERVE_ARGV: its serve flags, a port among them) as a child
    owned like the client's engines; returns (process, HTTP URL). RuntimeError with its last words when it
    exits first."""
    check_model_fits(cfg)
    proc, _, url = _spawn(cfg, serve_argv)
    return proc, url


def _spawn(cfg: EngineConfig, serve_argv: list[str]) -> tuple[subprocess.Popen, str, str]:
    ours, theirs = socket.socketpair()
    cmd = [sys.executable, "-m", "tandem.launch.cli", "serve", *config_to_argv(cfg), *serve_argv,
           "--owner-fd", str(theirs.fileno())]
    http = "--no-http" not in serve_argv
    try:
        # Its own session: a terminal's Ctrl-C goes to the whole foreground process group, and an engine
        # there would drain and stop on it (serve does on SIGINT) where its owner only meant to interrupt
        # itself (a reply in `tandem run`, a call at a REPL). The owner socket still stops it with us.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if http else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, pass_fds=(theirs.fileno(),),
                                start_new_session=True)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    _owners[proc.pid] = ours
    err_tail: deque[str] = deque(maxlen=40)
    # Drain stderr in the background so a chatty engine never blocks on a full pipe.
    drain = threading.Thread(target=lambda: err_tail.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    drain.start()
    # The child's launcher gives up after its startup timeout and exits (closing its end); a child stuck
    # before that point is bounded here, a little later.
    ours.settimeout(cfg.startup_timeout_s + READY_MARGIN_S)
    try:
        # the engine shuts its side once it has written
        record = b"".join(iter(lambda: ours.recv(65536), b""))
    except TimeoutError:
        stop_engine_process(proc)
        raise RuntimeError(f"engine not ready after {cfg.startup_timeout_s + READY_MARGIN_S:g} s "
                           "(--startup-timeout-s and a margin); stopped") from None
    except BaseException:  # interrupted while it starts: it must not outlive the call
        stop_engine_process(proc)
        raise
    msg = launcher_decoder()(record) if record else None
    if isinstance(msg, Ready):
        url = ""
        if http:  # serve printed its HTTP line before it wrote the record: it is in the pipe already
            _, url = read_until_http(proc.stdout, {})  # type: ignore[arg-type]
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
        if url or not http:
            return proc, msg.info, url
    stop_engine_process(proc)
    drain.join(5)  # the last words (why it failed) are still in the pipe
    raise RuntimeError(f"engine exited with code {proc.returncode} before it was ready:\n{''.join(err_tail)}")


def stop_engine_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    owner = _owners.pop(proc.pid, None)
    if owner is not None:
        owner.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def prompt_model(model: str, engine_options: dict[str, object]) -> str:
    """The model a client makes prompts for: with `mmproj`, the one directory the engine reads the text
    file and its projector as."""
    mmproj = engine_options.get("mmproj")
    return model if mmproj is None else str(projector_model_dir(model, str(mmproj)))

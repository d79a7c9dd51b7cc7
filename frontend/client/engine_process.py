"""An engine owned by a client: `tandem serve` as a child process, stopped with the client."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import deque

from launch.cli_options import config_to_argv
from launch.serve import READY_PREFIX
from protocol.engine_config import EngineConfig

_owner_pipes: dict[int, int] = {}  # engine pid -> the write end of its owner pipe, held while we own it


def start_engine_process(model: str, **options: object) -> tuple[subprocess.Popen, str]:
    cfg = EngineConfig.from_options(model, **options)  # unknown options fail here, in the caller
    # The client talks ZMQ: no HTTP server (it would also contend for the default port).
    # The engine watches the read end of this pipe: when this process dies, however it dies, the kernel
    # closes the write end and the engine stops. (PR_SET_PDEATHSIG alone would follow the calling thread.)
    owner_r, owner_w = os.pipe()
    cmd = [sys.executable, "-m", "launch.cli", "serve", *config_to_argv(cfg), "--no-http", "--owner-fd", str(owner_r)]
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(owner_r,),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except BaseException:
        os.close(owner_w)
        raise
    finally:
        os.close(owner_r)
    _owner_pipes[proc.pid] = owner_w
    err_tail: deque[str] = deque(maxlen=40)
    # Drain stderr in the background so a chatty engine never blocks on a full pipe.
    threading.Thread(target=lambda: [err_tail.append(line) for line in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(READY_PREFIX):
            endpoint = line[len(READY_PREFIX) :].strip()
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, endpoint
    proc.wait()
    raise RuntimeError(f"engine exited with code {proc.returncode} before it was ready:\n{''.join(err_tail)}")


def stop_engine_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    owner_w = _owner_pipes.pop(proc.pid, None)
    if owner_w is not None:
        os.close(owner_w)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode

"""`tandem serve` as a subprocess for HTTP tests: its ZMQ endpoint and HTTP URL from its stdout."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

from tandem.protocol.serve_announcements import wait_for_http


class Served:
    def __init__(self, model: Path, *flags: str, pin_dtype: bool = True) -> None:
        # float32 and a quantized file's exact products unless asked (as conftest's launch_client, and why);
        # pin_dtype=False: the user's default
        dtype = ("--dtype", "float32") if pin_dtype and "--dtype" not in flags else ()
        if pin_dtype and not any("int8-activations" in f for f in flags):
            dtype += ("--no-cpu-int8-activations",)
        cmd = [
            sys.executable,
            "-m",
            "tandem.launch.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",
            *dtype,
            *flags,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.err: deque[str] = deque(maxlen=40)
        threading.Thread(target=lambda: [self.err.append(x) for x in self.proc.stderr], daemon=True).start()  # type: ignore[union-attr]
        self.endpoint = self.url = ""
        self.pids: dict[str, int] = {}  # process name (tandem-http, tandem-worker0, ...) -> pid

    def ready(self) -> Served:
        """Wait for the engine and its HTTP server (several can start meanwhile)."""
        self.endpoint, self.url = wait_for_http(self.proc, self.pids, self.err)
        return self

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(45)  # SIGTERM drains: running requests get up to --drain-timeout-s (30 s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

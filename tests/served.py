"""`tandem serve` as a subprocess for HTTP tests: its ZMQ endpoint and HTTP URL from its stdout."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

from launch.serve import HTTP_PREFIX, PROCESS_PREFIX, READY_PREFIX


class Served:
    def __init__(self, model: Path, *flags: str) -> None:
        dtype = () if "--dtype" in flags else ("--dtype", "float32")  # as conftest's launch_client, and why
        cmd = [sys.executable, "-m", "launch.cli", "serve", "--model", str(model), "--port", "0", *dtype, *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.err: deque[str] = deque(maxlen=40)
        threading.Thread(target=lambda: [self.err.append(x) for x in self.proc.stderr], daemon=True).start()  # type: ignore[union-attr]
        self.endpoint = self.url = ""
        self.pids: dict[str, int] = {}  # process name (tandem-http, tandem-worker0, ...) -> pid

    def ready(self) -> Served:
        """Wait for the engine and its HTTP server (several can start meanwhile)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROCESS_PREFIX):
                name, pid = line[len(PROCESS_PREFIX):].split()
                self.pids[name] = int(pid)
            elif line.startswith(READY_PREFIX):
                self.endpoint = line[len(READY_PREFIX):].strip()
            elif line.startswith(HTTP_PREFIX + "http"):
                self.url = line[len(HTTP_PREFIX):].strip()
                break
        if not self.url:
            self.proc.wait()
            raise RuntimeError(f"tandem serve exited with {self.proc.returncode}:\n{''.join(self.err)}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # type: ignore[union-attr]
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

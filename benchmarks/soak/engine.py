"""The engine under test: `tandem serve` as a subprocess (ZMQ door and HTTP door), its processes by name."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import deque

import psutil

from tandem.protocol.serve_announcements import wait_for_http


class ServedEngine:
    def __init__(self, argv: list[str]) -> None:
        """argv: the `tandem serve` flags (model, engine options, --port ...)."""
        cmd = [sys.executable, "-m", "tandem.launch.cli", "serve", *argv]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.err: deque[str] = deque(maxlen=200)
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        self.endpoint = self.url = ""
        self.pids: dict[str, int] = {"tandem-serve": self.proc.pid}
        self.endpoint, self.url = wait_for_http(self.proc, self.pids, self.err)
        for p in psutil.Process(self.proc.pid).children():  # multiprocessing's resource tracker, unnamed
            if p.pid not in self.pids.values():
                self.pids[f"other-{p.pid}"] = p.pid

    def processes(self) -> dict[str, psutil.Process]:
        out = {}
        for name, pid in self.pids.items():
            try:
                out[name] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
        return out

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

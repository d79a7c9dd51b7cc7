"""What `tandem serve` prints on stdout for whoever started it (tests, benchmarks, supervisors): each
process's name and pid as it starts, the ZMQ endpoint once the engine is ready, then the HTTP URL."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterable

READY_PREFIX = "tandem: ready at "
HTTP_PREFIX = "tandem: "
PROCESS_PREFIX = "tandem: process "


def read_until_http(lines: Iterable[str], pids: dict[str, int]) -> tuple[str, str]:
    """Reads serve's stdout up to its HTTP line, adding each announced process to `pids` (name -> pid).
    Returns (endpoint, url); the url is "" when the output ended first (serve exited)."""
    endpoint = ""
    for line in lines:
        if line.startswith(PROCESS_PREFIX):
            name, pid = line[len(PROCESS_PREFIX):].split()
            pids[name] = int(pid)
        elif line.startswith(READY_PREFIX):
            endpoint = line[len(READY_PREFIX):].strip()
        elif line.startswith(HTTP_PREFIX + "http"):
            return endpoint, line[len(HTTP_PREFIX):].strip()
    return endpoint, ""


def wait_for_http(proc: subprocess.Popen, pids: dict[str, int], err: Iterable[str]) -> tuple[str, str]:
    """read_until_http on a serve subprocess's stdout (text mode), then its stdout drained on a thread so
    serve
    never blocks on a full pipe. Raises RuntimeError with `err` (its stderr as collected so far) when serve
    exited before its HTTP line."""
    assert proc.stdout is not None
    endpoint, url = read_until_http(proc.stdout, pids)
    if not url:
        proc.wait()
        raise RuntimeError(f"tandem serve exited with {proc.returncode}:\n{''.join(err)}")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return endpoint, url

"""What `tandem serve` prints on stdout for whoever started it (tests, benchmarks, supervisors): each
process's name and pid as it starts, the ZMQ endpoint once the engine is ready, then the HTTP URL."""

from __future__ import annotations

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

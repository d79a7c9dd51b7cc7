"""How long a server takes from its command to its first answer on /health, for `tandem serve` and
llama-server on the same file (issue 39: ready quickly). Each runs as a user starts it: a fresh process, the
file read from the page cache (a warm-up start first, not timed), ready when /health answers 200.

    python -m tandem.benchmarks.server_start --model M.gguf [--llama-cpp BUILD] [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tandem.benchmarks.llama_cpp import _free_port, find_binary, llama_server, server_flags, stop


def tandem_command(model: str, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "tandem.launch.cli", "serve", "--model", model, "--port", str(port), *extra]


def llama_command(build: Path, model: str, port: int, threads: int) -> list[str]:
    """llama-server with its defaults but the threads (and --no-repack where the build needs it to start:
    learn_flags)."""
    return [str(find_binary(build, "llama-server")), "-m", model, "-t", str(threads), "--host", "127.0.0.1",
            "--port", str(port), *server_flags(build)]


def learn_flags(build: Path, model: str, threads: int) -> None:
    """Start llama-server once, so a build that crashes without --no-repack is known before timing."""
    with llama_server(build, model, 1, 512, threads):
        pass


@contextlib.contextmanager
def started(cmd: list[str], port: int, timeout_s: float = 300.0) -> Iterator[tuple[str, float]]:
    """Runs cmd (a server on `port`); yields (base URL, seconds until /health answered 200); stops it after
    (SIGTERM, then SIGKILL)."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}: {proc.stderr.read()[-800:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"{cmd[0]} not ready after {timeout_s}s")
            time.sleep(0.02)
        yield url, time.perf_counter() - t0
    finally:
        stop(proc)


def time_to_ready(cmd_of_port, repeats: int) -> list[float]:
    """Seconds to ready of `repeats` fresh starts, after one untimed start (the page cache warm)."""
    times = []
    for i in range(repeats + 1):
        port = _free_port()
        with started(cmd_of_port(port), port) as (_, s):
            if i:
                times.append(s)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-cpp", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    ours = time_to_ready(lambda p: tandem_command(args.model, p), args.repeats)
    print(f"tandem serve ready: median {statistics.median(ours):.2f} s {[round(t, 2) for t in ours]}")
    if args.llama_cpp is not None:
        learn_flags(args.llama_cpp, args.model, os.cpu_count() or 1)
        theirs = time_to_ready(lambda p: llama_command(args.llama_cpp, args.model, p, os.cpu_count() or 1),
                               args.repeats)
        print(f"llama-server ready: median {statistics.median(theirs):.2f} s {[round(t, 2) for t in theirs]}")
        print(f"ratio tandem / llama-server: {statistics.median(ours) / statistics.median(theirs):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the HTTP door costs one stream: the same requests through the ZMQ client and through `/v1/completions`
(streamed), alternated in one engine, with the CPU time each process spends per output token.

    python -m tandem.benchmarks.http_door --model M.gguf [--rounds 4] [--output-len 128] [--prompt-len 64]

Wall TPOT moves with whatever else runs on the machine; the per-token CPU seconds of the HTTP and frontend
processes (beyond each one's idle rate, measured first) move much less, so both are printed. The door's share
of a step = (HTTP TPOT - ZMQ TPOT) / ZMQ TPOT.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

from tandem.frontend.client.client import Client
from tandem.launch.cli_options import add_engine_flags, config_from_args
from tandem.launch.launcher import Launcher
from tandem.protocol.serve_config import ServeConfig
from tandem.protocol.tokenizer_loader import load_tokenizer


def _tpot(token_times: list[float]) -> float:
    return (token_times[-1] - token_times[0]) / max(1, len(token_times) - 1)


def zmq_stream(client: Client, ids: list[int], n: int) -> tuple[list[float], int]:
    times, count = [], 0
    for d in client.stream(ids, {"max_tokens": n, "ignore_eos": True, "temperature": 0.0}):
        times.append(time.perf_counter())
        count += len(d.token_ids)
    return times, count


def http_stream(url: str, name: str, ids: list[int], n: int) -> tuple[list[float], int]:
    body = {
        "model": name,
        "prompt": ids,
        "max_tokens": n,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    times, count = [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
                count += 1
    return times, count


def cpu_of(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}


def idle_rates(procs: dict[str, psutil.Process], seconds: float = 3.0) -> dict[str, float]:
    """CPU seconds per second each process spends with nothing to do (watch threads, timers)."""
    before, t0 = cpu_of(procs), time.perf_counter()
    time.sleep(seconds)
    after, wall = cpu_of(procs), time.perf_counter() - t0
    return {k: (after[k] - before[k]) / wall for k in procs}


def measure(
    run: Callable[[], tuple[list[float], int]], procs: dict[str, psutil.Process], idle: dict[str, float]
) -> tuple[float, int, dict]:
    """TPOT, tokens, and each process's CPU seconds for the request beyond its idle rate."""
    before, t0 = cpu_of(procs), time.perf_counter()
    times, tokens = run()
    after, wall = cpu_of(procs), time.perf_counter() - t0
    return _tpot(times), tokens, {k: after[k] - before[k] - idle[k] * wall for k in procs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tandem.benchmarks.http_door", description=__doc__, allow_abbrev=False
    )
    add_engine_flags(p)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    tok = load_tokenizer(cfg.model)
    ids = tok.encode("The history of the city begins " * 64)[: args.prompt_len]
    launcher = Launcher(cfg, ServeConfig(port=0))
    endpoint = launcher.start()
    try:
        url, name = launcher.ready["http0"], Path(cfg.model).name
        procs = {pr.name.removeprefix("tandem-"): psutil.Process(pr.pid) for pr in launcher.procs}
        rows: dict[str, list] = {"zmq": [], "http": []}
        with Client(endpoint) as client:
            zmq_stream(client, ids, 8)  # warm both paths
            http_stream(url, name, ids, 8)
            idle = idle_rates(procs)
            for _ in range(args.rounds):
                rows["zmq"].append(measure(lambda: zmq_stream(client, ids, args.output_len), procs, idle))
                rows["http"].append(
                    measure(lambda: http_stream(url, name, ids, args.output_len), procs, idle)
                )
    finally:
        launcher.stop()
    out: dict = {}
    for door, rs in rows.items():
        tpot = statistics.median(r[0] for r in rs)
        tokens = sum(r[1] for r in rs)
        cpu = {k: sum(r[2][k] for r in rs) / tokens * 1e3 for k in procs}
        out[door] = {"tpot_ms": tpot * 1e3, "cpu_ms_per_token": cpu}
        print(f"{door:4s}: TPOT median {tpot * 1e3:.2f} ms; CPU ms/token "
              + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()))
    share = (out["http"]["tpot_ms"] - out["zmq"]["tpot_ms"]) / out["zmq"]["tpot_ms"]
    http_cpu = out["http"]["cpu_ms_per_token"].get("http", 0.0)
    out["door_share_of_step"] = share
    out["http_cpu_share_of_step"] = http_cpu / out["zmq"]["tpot_ms"]
    print(f"door: HTTP TPOT / ZMQ TPOT - 1 = {share:+.1%}; HTTP process CPU per token = "
          f"{out['http_cpu_share_of_step']:.1%} of a ZMQ step")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

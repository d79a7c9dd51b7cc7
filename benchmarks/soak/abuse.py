"""`tandem bench abuse`: the memory bounds under abuse at full size (docs/limits.md), each process's RSS
watched every half second: thousands of HTTP streams opened and never read, a 100 MB request body (by its
Content-Length, and chunked with none), and a thousand distinct grammars (at once, then a few at a time).
Afterwards the engine must still answer. Writes LABEL.json; exits 1 when the engine stopped answering."""
from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tandem import AsyncClient, Client
from tandem.benchmarks.soak.engine import ServedEngine
from tandem.frontend.client.engine_process import config_to_argv
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import TandemError

NAME = "abuse"


class PeakRss:
    """Each process's largest RSS while a scenario runs."""

    def __init__(self, engine: ServedEngine, period_s: float = 0.5) -> None:
        self.engine, self.period_s = engine, period_s
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def rss(self) -> dict[str, float]:
        out = {}
        for name, p in self.engine.processes().items():
            try:
                out[name] = p.memory_info().rss / 2**20
            except Exception:
                continue
        return out

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            for name, mb in self.rss().items():
                self.peak[name] = max(self.peak.get(name, 0.0), mb)

    def __enter__(self) -> PeakRss:
        self.before = self.rss()
        self.peak = dict(self.before)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self.rss()
        for name, mb in self.after.items():
            self.peak[name] = max(self.peak.get(name, 0.0), mb)

    def report(self) -> dict[str, dict[str, float]]:
        return {n: {"before_mb": round(self.before.get(n, 0), 1), "peak_mb": round(self.peak.get(n, 0), 1),
                    "after_mb": round(self.after.get(n, 0), 1)} for n in sorted(self.before)}


def unread_streams(engine: ServedEngine, n: int, max_tokens: int) -> dict[str, Any]:
    port = int(engine.url.rsplit(":", 1)[1])
    body = json.dumps({"model": NAME, "prompt": "Tell me a story", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    socks: list[socket.socket] = []
    t0 = time.monotonic()
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(head % len(body) + body)
        socks.append(s)
    opened_s = time.monotonic() - t0
    time.sleep(10)  # the admitted ones run, unread
    statuses: dict[str, int] = {}
    for s in socks:  # closing each aborts what it still runs
        s.settimeout(0.05)
        try:
            status = s.recv(16).split(b" ")[1].decode()
        except (OSError, IndexError):
            status = "no answer yet (queued)"
        statuses[status] = statuses.get(status, 0) + 1
        s.close()
    return {"streams": n, "opened_in_s": round(opened_s, 1), "statuses": statuses}


def _post_huge(host: str, port: int, mb: int, chunked: bool) -> dict[str, Any]:
    """POST mb MiB of body, watching for an answer before each MiB (a server that refuses it answers early
    and closes: a client that sent on before reading would meet a reset instead of the status)."""
    s = socket.create_connection((host, port), timeout=120)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {mb * 2**20}"
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{length}\r\n\r\n".encode()
    )
    chunk, sent = b" " * 2**20, 0
    try:
        while sent < mb and not select.select([s], [], [], 0.01)[0]:
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            sent += 1
        if sent == mb and chunked:
            s.sendall(b"0\r\n\r\n")
        status: int | str = int(s.recv(64).split(b" ")[1])
    except (OSError, IndexError, ValueError) as e:
        status = f"{type(e).__name__} before the status was read"
    finally:
        s.close()
    return {"status": status, "mib_sent": sent}


def huge_body(engine: ServedEngine, mb: int) -> dict[str, Any]:
    host, port = engine.url.removeprefix("http://").rsplit(":", 1)
    return {"with_content_length": _post_huge(host, int(port), mb, chunked=False),
            "chunked": _post_huge(host, int(port), mb, chunked=True)}


def many_grammars(endpoint: str, n: int, concurrency: int) -> dict[str, Any]:
    def schema(i: int) -> dict[str, Any]:
        return {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}

    async def run(offset: int, limit: int) -> dict[str, int]:
        client = AsyncClient(endpoint)
        slots = asyncio.Semaphore(limit)
        outcomes: dict[str, int] = {}

        async def one(i: int) -> None:
            async with slots:
                try:
                    await client.generate(
                        "JSON please", {"max_tokens": 16, "json_schema": schema(offset + i)}
                    )
                    key = "ok"
                except TandemError as e:
                    key = str(e.code)
                outcomes[key] = outcomes.get(key, 0) + 1

        await asyncio.gather(*(one(i) for i in range(n)))
        await client.close()
        return outcomes

    t0 = time.monotonic()
    burst = asyncio.run(run(0, n))
    t1 = time.monotonic()
    paced = asyncio.run(run(n, concurrency))
    return {
        "grammars": n,
        "at_once": burst,
        "at_once_s": round(t1 - t0, 1),
        f"{concurrency}_at_a_time": paced,
        "paced_s": round(time.monotonic() - t1, 1),
    }


def run(cfg: EngineConfig, max_concurrent: int, streams: int, stream_tokens: int, body_mb: int, grammars: int,
        result_dir: Path, label: str) -> int:
    engine = ServedEngine([*config_to_argv(cfg), "--port", "0", "--served-model-name", NAME,
                           "--max-concurrent-requests", str(max_concurrent)])
    result: dict[str, Any] = {
        "config": {
            **cfg.options(),
            "model": cfg.model,
            "max_concurrent_requests": max_concurrent,
            "streams": streams,
            "stream_tokens": stream_tokens,
            "body_mb": body_mb,
        }
    }
    try:
        probe = Client(engine.endpoint)
        for name, scenario in (("unread_streams", lambda: unread_streams(engine, streams, stream_tokens)),
                               ("huge_body", lambda: huge_body(engine, body_mb)),
                               ("grammars", lambda: many_grammars(engine.endpoint, grammars, 32))):
            with PeakRss(engine) as rss:
                outcome = scenario()
            st = probe.stats()
            result[name] = {
                **outcome,
                "rss": rss.report(),
                "grammar_cache_mb": round(st.grammar_cache_bytes / 2**20, 1),
            }
            print(f"{name}: {json.dumps(result[name])}", flush=True)
        c = probe.generate("still there?", {"max_tokens": 4, "ignore_eos": True})
        result["still_answering"] = c.completion_tokens == 4
        probe.close()
    finally:
        result["exit_code"] = engine.stop()
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / f"{label}.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0 if result.get("still_answering") and result["exit_code"] == 0 else 1

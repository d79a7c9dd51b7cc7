"""One streamed request to an OpenAI-compatible /v1/completions, timed chunk by chunk."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from tandem.benchmarks.serve_dataset import BenchRequest


@dataclass
class RequestResult:
    prompt_len: int
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0
    latency: float = 0.0  # e2e
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carried text
    token_times: list[float] = field(default_factory=list)  # perf_counter of each text chunk
    output_tokens: int = 0
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def _data(event: bytes) -> bytes:
    """An SSE event's data: its `data:` lines joined; comments (`:` keep-alives) and other fields ignored."""
    lines = event.replace(b"\r\n", b"\n").split(b"\n")
    return b"\n".join(x[5:].strip() for x in lines if x.startswith(b"data:"))


async def send(session: aiohttp.ClientSession, url: str, model: str, req: BenchRequest,
               headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    res = RequestResult(req.prompt_len)
    res.start = last = time.perf_counter()
    chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            buf = b""
            async for piece in r.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    data = _data(event)
                    if not data or data == b"[DONE]":
                        continue
                    try:
                        msg = json.loads(data)
                    except ValueError as e:
                        raise ValueError(f"{e}: {data[:200]!r}") from e
                    if msg.get("usage"):
                        res.output_tokens = msg["usage"].get("completion_tokens", 0)
                    if any(c.get("text") for c in msg.get("choices") or []):
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        res.token_times.append(now)
                        last, chunks = now, chunks + 1
        res.latency = time.perf_counter() - res.start
        res.output_tokens = res.output_tokens or chunks  # servers without a usage chunk: one token a chunk
        res.success = chunks > 0
        if not res.success:
            res.error = "no text came back"
    except (aiohttp.ClientError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res

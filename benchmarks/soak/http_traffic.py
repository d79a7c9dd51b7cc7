"""The HTTP door's traffic (aiohttp, one event loop, many concurrent clients): completions and chat, streamed
or not, streams left early, JSON mode, echoed prompt logprobs, every kind of bad request, over-large bodies
and health checks."""
from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from tandem.benchmarks.soak.kinds import Shape, bad_http, end_is_sound, text_prompt
from tandem.benchmarks.soak.ledger import Ledger, Record

KINDS = (
    ("completion", 3),
    ("chat_stream", 3),
    ("stream_left", 2),
    ("json", 1),
    ("echo_logprobs", 1),
    ("bad", 2),
    ("health", 0.5),
)
OK = ("ok",)


async def _error_outcome(r: aiohttp.ClientResponse) -> str:
    try:
        code = (await r.json(content_type=None))["error"]["code"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        code = None
    return f"http:{r.status}:{code}" if code else f"http:{r.status}"


async def _events(r: aiohttp.ClientResponse):
    """The data of each SSE event."""
    buf = b""
    async for piece in r.content.iter_any():
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = b"\n".join(x[5:].strip() for x in event.split(b"\n") if x.startswith(b"data:"))
            if data:
                yield data


class HttpTraffic:
    def __init__(self, url: str, shape: Shape, ledger: Ledger, deadline: float) -> None:
        self.url, self.shape, self.ledger, self.deadline = url, shape, ledger, deadline
        self.bad = bad_http(shape)

    def run(self, clients: int, seed: int, too_large_period_s: float) -> None:
        asyncio.run(self._run(clients, seed, too_large_period_s))

    async def _run(self, clients: int, seed: int, too_large_period_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.gather(*(self._client(s, seed + i) for i in range(clients)),
                                 self._too_large(s, too_large_period_s))

    async def _client(self, s: aiohttp.ClientSession, seed: int) -> None:
        rng = random.Random(seed)
        names, weights = zip(*KINDS)
        while time.monotonic() < self.deadline:
            kind = rng.choices(names, weights)[0]
            await getattr(self, f"_{kind}")(s, rng)

    async def _call(self, rec: Record, coro: Any) -> None:
        try:
            await coro
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            self.ledger.end(rec, f"exception:{type(e).__name__}", str(e)[:200])

    def _body(self, rng: random.Random, n: int, **more: Any) -> dict[str, Any]:
        return {"model": self.shape.model, "max_tokens": n, "temperature": rng.choice((0.0, 0.8)), **more}

    async def _completion(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        rec, n = self.ledger.begin("http.completion", OK, True), rng.randint(8, 128)

        async def go() -> None:
            async with s.post(
                self.url + "/v1/completions", json=self._body(rng, n, prompt=text_prompt(rng))
            ) as r:
                if r.status != 200:
                    self.ledger.end(rec, await _error_outcome(r))
                    return
                out = await r.json()
                got, why = out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]
                bad = "" if end_is_sound(why, got, n) else f"BAD: {why} {got}"
                self.ledger.end(rec, "ok", bad, got)

        await self._call(rec, go())

    async def _stream(self, s: aiohttp.ClientSession, rng: random.Random, leave_after: int | None) -> None:
        kind = "http.stream_left" if leave_after else "http.chat_stream"
        rec, n = self.ledger.begin(kind, ("left", "ok") if leave_after else OK, True), rng.randint(16, 160)
        if leave_after:
            path, body = "/v1/completions", self._body(rng, n, prompt=text_prompt(rng), stream=True)
        else:
            body = self._body(rng, n, messages=[{"role": "user", "content": text_prompt(rng)}], stream=True,
                              stream_options={"include_usage": True})
            path = "/v1/chat/completions"

        async def go() -> None:
            t0 = time.monotonic()
            first = last = None
            chunks = 0
            finish, used = None, None
            async with s.post(self.url + path, json=body) as r:
                if r.status != 200:
                    self.ledger.end(rec, await _error_outcome(r))
                    return
                async for data in _events(r):
                    if data == b"[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        self.ledger.end(rec, f"stream_error:{msg['error'].get('code')}")
                        return
                    for ch in msg.get("choices", []):
                        text = ch.get("text") or (ch.get("delta") or {}).get("content")
                        if text:
                            now = time.monotonic()
                            first, last, chunks = first or now, now, chunks + 1
                        finish = ch.get("finish_reason") or finish
                    if msg.get("usage"):  # the last chunk (stream_options.include_usage)
                        used = msg["usage"]["completion_tokens"]
                    if leave_after and chunks >= leave_after:
                        self.ledger.end(rec, "left", "", chunks, None if first is None else first - t0)
                        return  # the response closes here: the server aborts the request
            tpot = (
                (last - first) / (chunks - 1)
                if first is not None and last is not None and chunks > 1
                else None
            )
            bad = "" if end_is_sound(finish, n if used is None else used, n) and (
                finish == "stop" or used is not None) else f"BAD: finish {finish}, {used} tokens of {n}"
            self.ledger.end(rec, "ok", bad, chunks, None if first is None else first - t0, tpot)

        await self._call(rec, go())

    async def _chat_stream(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        await self._stream(s, rng, None)

    async def _stream_left(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        await self._stream(s, rng, rng.randint(1, 10))

    async def _json(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        rec = self.ledger.begin("http.json", OK, True)
        body = self._body(
            rng,
            64,
            messages=[{"role": "user", "content": "Answer in JSON: " + text_prompt(rng)}],
            response_format={"type": "json_object"},
        )

        async def go() -> None:
            async with s.post(self.url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    self.ledger.end(rec, await _error_outcome(r))
                    return
                out = await r.json()
                choice = out["choices"][0]
                bad = ""
                if choice["finish_reason"] == "stop":
                    try:
                        json.loads(choice["message"]["content"])
                    except ValueError:
                        bad = f"BAD: not JSON: {choice['message']['content'][:80]!r}"
                self.ledger.end(rec, "ok", bad, out["usage"]["completion_tokens"])

        await self._call(rec, go())

    async def _echo_logprobs(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        rec = self.ledger.begin("http.echo_logprobs", OK, True)
        body = self._body(rng, 4, prompt=text_prompt(rng, 2, 30), echo=True, logprobs=2)

        async def go() -> None:
            async with s.post(self.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    self.ledger.end(rec, await _error_outcome(r))
                    return
                out = await r.json()
                u, lp = out["usage"], out["choices"][0]["logprobs"]
                want = u["prompt_tokens"] + u["completion_tokens"]
                bad = "" if len(lp["tokens"]) == want else f"BAD: {len(lp['tokens'])} logprobs, want {want}"
                self.ledger.end(rec, "ok", bad, u["completion_tokens"])

        await self._call(rec, go())

    async def _bad(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        name, body, status, code = rng.choice(self.bad)
        rec = self.ledger.begin(
            f"http.bad.{name}", (f"http:{status}:{code}" if code else f"http:{status}",), False
        )

        async def go() -> None:
            kw: dict[str, Any] = {"data": body, "headers": {"Content-Type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            async with s.post(self.url + "/v1/completions", **kw) as r:
                outcome = await _error_outcome(r) if r.status != 200 else "ok"
                self.ledger.end(
                    rec, outcome if code or not outcome.startswith(f"http:{status}") else f"http:{status}"
                )

        await self._call(rec, go())

    async def _health(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        rec = self.ledger.begin("http.health", ("http:200",), False)

        async def go() -> None:
            async with s.get(self.url + "/health") as r:
                self.ledger.end(rec, f"http:{r.status}")

        await self._call(rec, go())

    async def _too_large(self, s: aiohttp.ClientSession, period_s: float) -> None:
        """A body over --max-request-bytes, now and then: 413, by its Content-Length."""
        big = b" " * (self.shape.max_request_bytes + 1)
        while time.monotonic() < self.deadline:
            rec = self.ledger.begin("http.bad.too_large", ("http:413:invalid_request.too_large",), False)

            async def go(rec: Record = rec) -> None:
                async with s.post(self.url + "/v1/completions", data=big,
                                  headers={"Content-Type": "application/json"}) as r:
                    self.ledger.end(rec, await _error_outcome(r))

            await self._call(rec, go())
            await asyncio.sleep(min(period_s, max(0.0, self.deadline - time.monotonic())))

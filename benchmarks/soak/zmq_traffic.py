"""The Python door's traffic: Client threads, an AsyncClient whose calls are cancelled, a second client that
reuses a live request id, raw frames the frontend must refuse, and grammars that outlast their timeout."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import Any

import msgspec
import zmq

from tandem import AsyncClient, Client
from tandem.benchmarks.soak.kinds import (
    CHOICES,
    SCHEMAS,
    Shape,
    bad_zmq,
    end_is_sound,
    id_prompt,
    slow_schema,
    text_prompt,
)
from tandem.benchmarks.soak.ledger import Ledger, Record
from tandem.protocol.codec import encode, frontend_decoder
from tandem.protocol.errors import ErrorCode, TandemError
from tandem.protocol.messages import GenerateRequest, RequestError

KINDS = (("generate", 4), ("greedy", 4), ("stream", 3), ("stream_left", 2), ("chat", 1), ("logprobs", 1), ("json", 1),
         ("choice", 1), ("bad", 2), ("bad_grammar", 0.3), ("duplicate_rid", 0.3))
OK = ("ok",)


def _params(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    p: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": rng.choice((0.0, 0.7, 1.0)),
        "seed": rng.randrange(1 << 30),
    }
    if rng.random() < 0.3:
        p["top_p"] = 0.9
    if rng.random() < 0.2:
        p["stop"] = ["\n\n"]
    return p


def _check_end(c: Any, max_tokens: int) -> str:
    if not end_is_sound(c.finish_reason, c.completion_tokens, max_tokens):
        return f"BAD: finish {c.finish_reason}, {c.completion_tokens} tokens of {max_tokens}"
    return ""


# Greedy requests over a few fixed prompts: their outputs under load are compared, token for token, with the
# same prompts run one at a time on the idle engine after the traffic (run.py, greedy_check).
GREEDY_PROMPTS = 8
GREEDY_TOKENS = 64
GREEDY = {"max_tokens": GREEDY_TOKENS, "temperature": 0.0, "ignore_eos": True}


def greedy_prompt(shape: Shape, i: int) -> list[int]:
    return id_prompt(random.Random(1000 + i), shape, 20, 300)


class ZmqTraffic:
    def __init__(self, endpoint: str, shape: Shape, ledger: Ledger, deadline: float) -> None:
        self.endpoint, self.shape, self.ledger, self.deadline = endpoint, shape, ledger, deadline
        self.client = Client(endpoint)
        self.other = Client(endpoint)  # reuses live request ids of `client`: the frontend refuses them
        self.bad = bad_zmq(shape)
        self.greedy_outputs: dict[int, list[list[int]]] = {}  # prompt index -> each output it got under load
        self._greedy_lock = threading.Lock()

    def close(self) -> None:
        self.client.close()
        self.other.close()

    # ---- Client threads ----------------------------------------------------------------------------
    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        names, weights = zip(*KINDS)
        while time.monotonic() < self.deadline:
            kind = rng.choices(names, weights)[0]
            getattr(self, f"_{kind}")(rng)

    def _run(self, rec: Record, call: Any) -> None:
        try:
            call()
        except TandemError as e:
            self.ledger.end(rec, f"error:{e.code}", str(e)[:200])
        except Exception as e:  # the soak reports it, and goes on
            self.ledger.end(rec, f"exception:{type(e).__name__}", str(e)[:200])

    def _generate(self, rng: random.Random, chat: bool = False) -> None:
        rec = self.ledger.begin("zmq.chat" if chat else "zmq.generate", OK, True)
        n = rng.randint(8, 128)
        prompt: Any = [{"role": "user", "content": text_prompt(rng)}] if chat else (
            text_prompt(rng) if rng.random() < 0.5 else id_prompt(rng, self.shape))

        def call() -> None:
            c = self.client.generate(prompt, _params(rng, n))
            self.ledger.end(rec, "ok", _check_end(c, n), c.completion_tokens)

        self._run(rec, call)

    def _greedy(self, rng: random.Random) -> None:
        rec = self.ledger.begin("zmq.greedy", OK, True)
        i = rng.randrange(GREEDY_PROMPTS)

        def call() -> None:
            c = self.client.generate(greedy_prompt(self.shape, i), GREEDY)
            with self._greedy_lock:
                self.greedy_outputs.setdefault(i, []).append(list(c.token_ids))
            self.ledger.end(rec, "ok", _check_end(c, GREEDY_TOKENS), c.completion_tokens)

        self._run(rec, call)

    def _chat(self, rng: random.Random) -> None:
        self._generate(rng, chat=True)

    def _stream(self, rng: random.Random, leave_after: int | None = None) -> None:
        rec = self.ledger.begin(
            "zmq.stream_left" if leave_after else "zmq.stream", ("left", "ok") if leave_after else OK, True
        )
        n = rng.randint(16, 160)

        def call() -> None:
            t0 = time.monotonic()
            first = last = None
            tokens = deltas = 0
            for d in self.client.stream(id_prompt(rng, self.shape), _params(rng, n)):
                now = time.monotonic()
                if d.token_ids and first is None:
                    first = now
                last, tokens, deltas = now, tokens + len(d.token_ids), deltas + 1
                if d.finished:
                    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
                    detail = "" if end_is_sound(d.finish_reason, tokens, n) else f"BAD: {d.finish_reason} {tokens}"
                    self.ledger.end(rec, "ok", detail, tokens, None if first is None else first - t0, tpot)
                    return
                if leave_after and deltas >= leave_after:
                    break  # leaving the loop closes the stream: the engine aborts the request
            self.ledger.end(rec, "left", "", tokens, None if first is None else first - t0)

        self._run(rec, call)

    def _stream_left(self, rng: random.Random) -> None:
        self._stream(rng, leave_after=rng.randint(1, 12))

    def _logprobs(self, rng: random.Random) -> None:
        rec = self.ledger.begin("zmq.logprobs", OK, True)
        prompt, n = id_prompt(rng, self.shape, 4, 120), rng.randint(4, 32)

        def call() -> None:
            c = self.client.generate(prompt, {**_params(rng, n), "logprobs": 3, "prompt_logprobs": 2})
            got = (
                len(c.logprobs.token_ids) if c.logprobs else 0,
                len(c.prompt_logprobs.token_ids) if c.prompt_logprobs else 0,
            )
            want = (c.completion_tokens, len(prompt) - 1)
            detail = _check_end(c, n) or ("" if got == want else f"BAD: logprobs for {got}, want {want}")
            self.ledger.end(rec, "ok", detail, c.completion_tokens)

        self._run(rec, call)

    def _json(self, rng: random.Random) -> None:
        rec = self.ledger.begin("zmq.json", OK, True)
        schema = rng.choice(SCHEMAS)

        def call() -> None:
            c = self.client.generate(
                text_prompt(rng), {"max_tokens": 64, "temperature": 0.0, "json_schema": schema}
            )
            detail = _check_end(c, 64)
            if c.finish_reason == "stop":
                try:
                    json.loads(c.text)
                except ValueError:
                    detail = f"BAD: not JSON: {c.text[:80]!r}"
            self.ledger.end(rec, "ok", detail, c.completion_tokens)

        self._run(rec, call)

    def _choice(self, rng: random.Random) -> None:
        rec = self.ledger.begin("zmq.choice", OK, True)

        def call() -> None:
            c = self.client.generate(text_prompt(rng), {"max_tokens": 8, "choice": CHOICES})
            ok = c.finish_reason == "stop" and c.text in CHOICES
            self.ledger.end(
                rec, "ok", "" if ok else f"BAD: {c.finish_reason} {c.text!r}", c.completion_tokens
            )

        self._run(rec, call)

    def _bad(self, rng: random.Random) -> None:
        name, prompt, params, code = rng.choice(self.bad)
        rec = self.ledger.begin(f"zmq.bad.{name}", (f"error:{code}",), False)
        self._run(
            rec, lambda: self.ledger.end(rec, "ok", str(self.client.generate(prompt, params).text)[:80])
        )

    def _bad_grammar(self, rng: random.Random) -> None:
        rec = self.ledger.begin("zmq.bad.grammar", (f"error:{ErrorCode.INVALID_GRAMMAR}",), True)
        self._run(
            rec, lambda: self.ledger.end(rec, "ok", self.client.generate("hi", {"regex": "(["}).text[:80])
        )

    def _duplicate_rid(self, rng: random.Random) -> None:
        live = self.ledger.begin("zmq.stream_left", ("left", "ok"), True)
        rid = f"soak-{rng.randrange(1 << 62)}"
        dup = None
        try:
            # the first must still run when its rid comes again: 64 tokens ended before the duplicate arrived
            # on a fast step (its rid then free, the duplicate served: an outcome the soak counted as wrong);
            # it is closed (cancelled) right after
            prompt = id_prompt(rng, self.shape, hi=64)
            stream = self.client.stream(
                prompt, {"max_tokens": self.shape.context - len(prompt), "ignore_eos": True}, request_id=rid
            )
            first = next(stream)
            dup = self.ledger.begin("zmq.bad.duplicate_rid", (f"error:{ErrorCode.DUPLICATE_RID}",), False)
            if first.finished:  # too quick to be reused: nothing to test this time
                self.ledger.end(live, "ok", "", len(first.token_ids))
                self.ledger.end(dup, f"error:{ErrorCode.DUPLICATE_RID}", "skipped: the first ended at once")
                return
            self._run(dup, lambda: self.ledger.end(dup, "ok", self.other.generate("hi", {"max_tokens": 2},
                                                                                request_id=rid).text))
            stream.close()
            self.ledger.end(live, "left")
        except TandemError as e:
            self.ledger.end(live, f"error:{e.code}", str(e)[:200])

    # ---- other doors of the same socket ------------------------------------------------------------
    def slow_grammars(self, period_s: float) -> None:
        """One grammar at a time that compiles for longer than the timeout (it holds a compile thread)."""
        tag = 0
        while time.monotonic() + period_s < self.deadline:
            rec = self.ledger.begin("zmq.slow_grammar", (f"error:{ErrorCode.GRAMMAR_TIMEOUT}",), True)
            schema = slow_schema(self.shape, tag)
            self._run(rec, lambda rec=rec, s=schema: self.ledger.end(
                rec, "ok", self.client.generate("hi", {"json_schema": s}).text))
            tag += 1
            time.sleep(period_s)

    def cancelled_calls(self, seed: int) -> None:
        asyncio.run(self._cancelled_calls(seed))

    async def _cancelled_calls(self, seed: int) -> None:
        rng = random.Random(seed)
        client = AsyncClient(self.endpoint)
        try:
            while time.monotonic() < self.deadline:
                rec = self.ledger.begin("zmq.cancelled", ("cancelled", "ok"), True)
                n = rng.randint(64, 256)
                task = asyncio.ensure_future(client.generate(id_prompt(rng, self.shape), {"max_tokens": n}))
                await asyncio.sleep(rng.uniform(0.05, 1.0))
                task.cancel()
                try:
                    c = await task
                    self.ledger.end(rec, "ok", _check_end(c, n), c.completion_tokens)
                except asyncio.CancelledError:
                    self.ledger.end(rec, "cancelled")
                except TandemError as e:
                    self.ledger.end(rec, f"error:{e.code}", str(e)[:200])
                await asyncio.sleep(rng.uniform(0.0, 1.0))
        finally:
            await client.close()

    def raw_frames(self, period_s: float, too_large_every: int) -> None:
        """Frames no client library sends: each is refused (answered when its request id can be read)."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        decode = frontend_decoder()
        big = b"x" * (self.shape.max_request_bytes + 1)
        n = 0
        try:
            while time.monotonic() < self.deadline:
                rid = f"raw-{n}"
                frames: list[tuple[str, list[bytes], str]] = [
                    (
                        "malformed",
                        [msgspec.msgpack.encode({"type": "nope", "rid": rid})],
                        f"error:{ErrorCode.MALFORMED}",
                    ),
                    ("garbage", [b"\xc1\x00"], "unanswered"),
                    ("bad_rid", [encode(GenerateRequest("", text="hi"))], "unanswered"),
                    ("extra_frames", [b"a", b"b"], "unanswered"),
                ]
                if n % too_large_every == 0:
                    frames.append(
                        (
                            "too_large",
                            [msgspec.msgpack.encode({"type": "generate", "rid": rid, "text": big})],
                            f"error:{ErrorCode.TOO_LARGE}",
                        )
                    )
                name, parts, expect = frames[n % len(frames)] if n % too_large_every else frames[-1]
                rec = self.ledger.begin(f"zmq.raw.{name}", (expect,), False)
                sock.send_multipart(parts)
                outcome = "unanswered"
                if sock.poll(5000 if expect != "unanswered" else 1000):
                    msg = decode(sock.recv())
                    outcome = f"error:{msg.code}" if isinstance(msg, RequestError) else type(msg).__name__
                self.ledger.end(rec, outcome)
                n += 1
                time.sleep(period_s)
        finally:
            sock.close(0)
            ctx.term()

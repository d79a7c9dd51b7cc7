"""`make demo`: pull SmolLM2-135M-Instruct if absent, serve its GGUF file (on CPU its Q4_1 weights run
quantized, as llama.cpp runs them), stream four concurrent chat requests (one in Chinese, one constrained
to a JSON schema) through the client, print each answer as it arrives with its tokens/s, shut down.

Four streams interleaved token by token would be unreadable, and prefixed lines would show nothing until
a line is complete: the answers are printed one after the other instead, each streamed live while it is
being generated (a later one catches up at once with what it already has), so the first text shows at
the first token and each answer stays one readable block."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}

# (messages, extra sampling parameters)
REQUESTS: list[tuple[list[dict[str, str]], dict[str, object]]] = [
    ([{"role": "user", "content": "What is the capital of France?"}], {}),
    ([{"role": "user", "content": "Write a Python function that checks whether a number is prime."}], {}),
    ([{"role": "user", "content": "你好！请用一句话介绍你自己。"}], {}),
    (
        [{"role": "user", "content": "Name one city in Japan and its country, as JSON."}],
        {"json_schema": CITY_SCHEMA},
    ),
]


class _Stream:
    """One request's answer as it arrives, and its timing."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0
        self.start = time.perf_counter()
        self.first: float | None = None
        self.end: float | None = None
        self.error: Exception | None = None
        self.changed = asyncio.Event()

    def summary(self, i: int) -> str:
        if self.error is not None:
            return f"[stream {i}: failed: {self.error}]"
        assert self.end is not None and self.first is not None
        took = self.end - self.start
        return (
            f"[stream {i}: {self.tokens} tokens in {took:.2f}s, first after {self.first - self.start:.2f}s: "
            f"{self.tokens / took:.1f} tokens/s]"
        )


async def _show(i: int, s: _Stream, messages: list[dict[str, str]], extra: dict[str, object]) -> None:
    """Print stream i: what arrived while the ones before it were shown, then each piece as it comes."""
    print(f"> {messages[-1]['content']}", flush=True)
    shown = 0
    while True:
        text = s.text.lstrip() if shown == 0 else s.text  # the model's leading newline
        if len(text) > shown:
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown, s.text = len(text), text
        if s.end is not None or s.error is not None:
            break
        s.changed.clear()
        await s.changed.wait()
    if "json_schema" in extra and s.error is None:
        print(f"\n  (parses as JSON: {json.loads(s.text)})", end="")
    print(f"\n{s.summary(i)}\n", flush=True)


async def _run(model: str) -> None:
    from tandem import AsyncClient, SamplingParams

    t0 = time.perf_counter()
    async with AsyncClient.launch(model) as client:
        print(f"engine ready in {time.perf_counter() - t0:.1f}s at {client.endpoint}", flush=True)
        print(
            f"{len(REQUESTS)} requests run concurrently (batched by the engine); each answer is shown whole, "
            "in order, streamed while it is being generated\n",
            flush=True,
        )
        streams = [_Stream() for _ in REQUESTS]

        async def one(i: int) -> None:
            messages, extra = REQUESTS[i]
            params = SamplingParams(max_tokens=96, temperature=0.0, **extra)  # type: ignore[arg-type]
            s = streams[i]
            try:
                async for d in client.stream(messages, params):
                    s.first = s.first or time.perf_counter()
                    s.text += d.text
                    s.tokens += len(d.token_ids)
                    s.changed.set()
            except Exception as e:  # shown in its place; the other streams go on
                s.error = e
            s.end = time.perf_counter()
            s.changed.set()

        t1 = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(REQUESTS))]
        for i, (messages, extra) in enumerate(REQUESTS):
            await _show(i, streams[i], messages, extra)
        await asyncio.gather(*tasks)
        dt = time.perf_counter() - t1
        total = sum(s.tokens for s in streams)
        print(
            f"{total} tokens from {len(REQUESTS)} concurrent streams in {dt:.2f}s ({total / dt:.1f} tokens/s)"
        )
    print("engine stopped cleanly")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    default = f"models/{DEFAULT_MODEL}/model.gguf"
    ap.add_argument("--model", default=default,
                    help="a model directory or .gguf file; the default is pulled when absent")
    args = ap.parse_args(argv)
    if args.model == default and not Path(args.model).exists():
        from tandem.launch.pull import pull

        print(f"pulling {DEFAULT_MODEL} into {Path(default).parent} ...", flush=True)
        pull(DEFAULT_MODEL, Path(default).parent)
    asyncio.run(_run(args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

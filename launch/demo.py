"""`make demo`: pull SmolLM2-135M-Instruct if absent, serve its GGUF file (on CPU its Q4_1 weights run
quantized, as llama.cpp runs them), stream four concurrent chat requests (one in Chinese, one constrained
to a JSON schema) through the client, print the answers, shut down."""
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
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}},
    "required": ["city", "country"],
    "additionalProperties": False,
}

# (messages, extra sampling parameters)
REQUESTS: list[tuple[list[dict[str, str]], dict[str, object]]] = [
    ([{"role": "user", "content": "What is the capital of France?"}], {}),
    ([{"role": "user", "content": "Write a Python function that checks whether a number is prime."}], {}),
    ([{"role": "user", "content": "你好！请用一句话介绍你自己。"}], {}),
    ([{"role": "user", "content": "Name one city in Japan and its country, as JSON."}], {"json_schema": CITY_SCHEMA}),
]


async def _run(model: str) -> None:
    from frontend import AsyncClient
    from protocol import SamplingParams

    t0 = time.perf_counter()
    async with AsyncClient.launch(model) as client:
        print(f"engine ready in {time.perf_counter() - t0:.1f}s at {client.endpoint}\n", flush=True)
        texts = [""] * len(REQUESTS)

        async def one(i: int) -> int:
            messages, extra = REQUESTS[i]
            params = SamplingParams(max_tokens=96, temperature=0.0, **extra)  # type: ignore[arg-type]
            n = 0
            async for d in client.stream(messages, params):
                texts[i] += d.text
                n += len(d.token_ids)
            return n

        t1 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(len(REQUESTS))))
        dt = time.perf_counter() - t1
        for (messages, extra), text in zip(REQUESTS, texts):
            print(f"> {messages[-1]['content']}")
            print(text.strip())
            if "json_schema" in extra:
                print(f"  (parses as JSON: {json.loads(text)})")
            print()
        print(f"{sum(counts)} tokens from {len(REQUESTS)} concurrent streams in {dt:.2f}s "
              f"({sum(counts) / dt:.1f} tokens/s)")
    print("engine stopped cleanly")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    default = f"models/{DEFAULT_MODEL}/model.gguf"
    ap.add_argument("--model", default=default,
                    help="a model directory or .gguf file; the default is pulled when absent")
    args = ap.parse_args(argv)
    if args.model == default and not Path(args.model).exists():
        from launch.pull import pull

        print(f"pulling {DEFAULT_MODEL} into {Path(default).parent} ...", flush=True)
        pull(DEFAULT_MODEL, Path(default).parent)
    asyncio.run(_run(args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

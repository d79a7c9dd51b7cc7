"""`make demo`: make the bench-size model if absent, serve it, stream a few concurrent prompts
(one in Chinese) through the client, print them, shut down cleanly."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

PROMPTS = [
    [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
    [{"role": "user", "content": "请用三句话介绍一下长城。"}],
    "The three most important ideas in computer science are",
    "def fibonacci(n):",
]


async def _run(model: str) -> None:
    from frontend import AsyncClient
    from protocol import SamplingParams

    t0 = time.perf_counter()
    async with AsyncClient.launch(model) as client:
        print(f"engine ready in {time.perf_counter() - t0:.1f}s at {client.endpoint}\n", flush=True)
        texts = [""] * len(PROMPTS)

        async def one(i: int) -> int:
            n = 0
            params = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=i)
            async for d in client.stream(PROMPTS[i], params):
                texts[i] += d.text
                n += len(d.token_ids)
            return n

        t1 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        dt = time.perf_counter() - t1
        for p, text in zip(PROMPTS, texts):
            shown = p if isinstance(p, str) else p[-1]["content"]
            print(f"> {shown}\n{text!r}\n")
        print(f"{sum(counts)} tokens from {len(PROMPTS)} concurrent streams in {dt:.2f}s")
        print("(random weights: the text is noise; the plumbing is real)")
    print("engine stopped cleanly")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--model", default="models/bench-llama")
    args = ap.parse_args(argv)
    if not (Path(args.model) / "config.json").exists():
        from launch.make_model import make_model

        print(f"making the bench-size model in {args.model} ...", flush=True)
        make_model("llama", "bench", args.model, seed=0)
    asyncio.run(_run(args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

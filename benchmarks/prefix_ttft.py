"""Time to first token for requests sharing a long system prompt: prefix cache on vs off, one run.

Each engine first serves one request with the system prompt (traffic that came before), then N
requests with the same system prompt and their own question arrive together; TTFT is measured per
request from submit to its first token.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from typing import Any

from tandem.protocol.engine_config import EngineConfig


async def _ttfts(client: Any, prompts: list[list[int]]) -> list[float]:
    from tandem import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def one(p: list[int]) -> float:
        t0 = time.perf_counter()
        async for d in client.stream(p, params):
            if d.token_ids:
                return time.perf_counter() - t0
        raise RuntimeError("no token")

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _measure(cfg: EngineConfig, system: list[int], prompts: list[list[int]]) -> dict[str, float]:
    from tandem import AsyncClient

    async def go() -> dict[str, float]:
        opts = cfg.options()
        async with AsyncClient.launch(cfg.model, **opts) as client:
            await client.generate(system + [5], {"max_tokens": 4})  # earlier traffic, same system prompt
            before = await client.stats()
            t = await _ttfts(client, prompts)
            after = await client.stats()
        return {
            "ttft_mean_ms": 1000 * statistics.mean(t),
            "ttft_median_ms": 1000 * statistics.median(t),
            "ttft_max_ms": 1000 * max(t),
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        }

    return asyncio.run(go())


def run(
    cfg: EngineConfig, num_requests: int, system_len: int, question_len: int, seed: int
) -> dict[str, Any]:
    from tandem.protocol.model_info import read_model_info

    vocab = read_model_info(cfg.model).vocab_size
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(question_len)] for _ in range(num_requests)]
    on = _measure(dataclasses.replace(cfg, prefix_cache=True), system, prompts)
    off = _measure(dataclasses.replace(cfg, prefix_cache=False), system, prompts)
    ratio = off["ttft_mean_ms"] / on["ttft_mean_ms"]
    print(f"prefix TTFT: {num_requests} concurrent requests, shared system prompt {system_len} tokens "
          f"+ {question_len} own tokens")
    for name, r in (("cache on ", on), ("cache off", off)):
        print(f"  {name}: TTFT mean {r['ttft_mean_ms']:.1f} ms, median {r['ttft_median_ms']:.1f} ms, "
              f"max {r['ttft_max_ms']:.1f} ms, prefill tokens {r['prefill_tokens']}")
    print(f"RESULT ttft_ratio_off_over_on={ratio:.2f}x")
    return {"benchmark": "prefix_ttft", "num_requests": num_requests, "system_len": system_len,
            "question_len": question_len, "cache_on": on, "cache_off": off, "ratio": ratio}

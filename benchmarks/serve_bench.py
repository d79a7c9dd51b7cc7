"""`tandem bench serve`: load any OpenAI-compatible server (tandem, llama-server, vLLM) at Poisson
request rates; TTFT, ITL, TPOT, e2e, throughput and goodput under SLOs, with vLLM's result keys."""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from tandem.benchmarks.serve_client import RequestResult, send
from tandem.benchmarks.serve_dataset import BenchRequest


async def _run_rate(
    url: str,
    model: str,
    reqs: Sequence[BenchRequest],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    headers: dict[str, str],
    label: str,
) -> tuple[list[RequestResult], float, float]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(reqs), desc=label)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(r: BenchRequest) -> RequestResult:
            if limit is None:
                res = await send(session, url, model, r, headers)
            else:
                async with limit:
                    res = await send(session, url, model, r, headers)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for r in reqs:
            tasks.append(asyncio.create_task(one(r)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = list(await asyncio.gather(*tasks))
        t1 = time.perf_counter()
    bar.close()
    return results, t0, t1


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.array(values_s or [0.0]) * 1000.0
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(np.percentile(ms, 90)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], t0: float, t1: float, rate: float, max_concurrency: int | None,
              slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    duration = t1 - t0
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = [r for r in ok if (slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
            and (slo_tpot_ms is None or r.tpot * 1000 <= slo_tpot_ms)]
    # Output tokens per wall-clock second since the start: each text chunk carries tokens/chunks of its
    # request.
    timeline = [0.0] * (int(duration) + 1)
    for r in ok:
        per_chunk = r.output_tokens / max(1, len(r.token_times))
        for t in r.token_times:
            timeline[min(len(timeline) - 1, int(t - t0))] += per_chunk
    return {
        "request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": max_concurrency,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "request_goodput": len(good) / duration if (slo_ttft_ms or slo_tpot_ms) else None,
        **_stats("ttft", [r.ttft for r in ok]), **_stats("tpot", [r.tpot for r in ok if r.output_tokens > 1]),
        **_stats("itl", [x for r in ok for x in r.itl]), **_stats("e2el", [r.latency for r in ok]),
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "errors": [r.error for r in results], "output_throughput_timeline": timeline,
    }


def run(base_url: str, model: str, reqs: Sequence[BenchRequest], rates: Sequence[float],
        max_concurrency: int | None, seed: int, api_key: str | None, slo_ttft_ms: float | None,
        slo_tpot_ms: float | None) -> list[dict[str, Any]]:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = []
    for rate in rates:
        results, t0, t1 = asyncio.run(_run_rate(url, model, reqs, rate, max_concurrency, seed, headers,
                                                f"rate {rate}"))
        s = summarize(results, t0, t1, rate, max_concurrency, slo_ttft_ms, slo_tpot_ms)
        print(f"rate {rate}: {s['completed']}/{len(results)} ok, {s['request_throughput']:.2f} req/s, "
              f"{s['output_throughput']:.1f} out tok/s, TTFT p50 {s['median_ttft_ms']:.0f} ms "
              f"p99 {s['p99_ttft_ms']:.0f} ms, TPOT p50 {s['median_tpot_ms']:.1f} ms, ITL p50 "
              f"{s['median_itl_ms']:.1f} ms", flush=True)
        first_error = next((e for e in s["errors"] if e), None)
        if first_error:
            print(f"  first error: {first_error}", flush=True)
        out.append(s)
    return out

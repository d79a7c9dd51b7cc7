"""Priorities under KV pressure: the same mixed-priority burst served with --scheduling-policy fcfs and then
priority, on a KV pool a quarter of what the requests need together.

    python -m tandem.benchmarks.priority_bench --model M [engine flags] [--num-requests 48] [--high-share
    0.25]

A share of the requests is high priority (0), the rest low (1), shuffled; every request is sent at once
(or `--interval-ms` apart). The pool (--kv-cache-tokens, default: a quarter of the sum of prompt and
output tokens) cannot hold them all, so they queue and, while decoding, retract one another. TTFT is the
scheduler's (arrival to first token, from the request's final metrics), its p50 per class is reported for
both policies, and the greedy tokens of the two runs are compared request by request.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from tandem.launch.cli_options import add_engine_flags, config_from_args
from tandem.protocol.engine_config import EngineConfig

HIGH, LOW = 0, 1


def make_workload(vocab: int, n: int, input_len: tuple[int, int], high_share: float,
                  seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    n_high = round(n * high_share)
    prios = [HIGH] * n_high + [LOW] * (n - n_high)
    rng.shuffle(prios)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*input_len))], p) for p in prios]


def _measure(cfg: EngineConfig, work: list[tuple[list[int], int]], output_len: int,
             interval_ms: float) -> dict[str, Any]:
    from tandem import AsyncClient

    params = {"max_tokens": output_len, "temperature": 0.0, "ignore_eos": True}

    async def go() -> dict[str, Any]:
        async with AsyncClient.launch(cfg.model, **cfg.options()) as client:
            await client.generate([5, 6, 7], {"max_tokens": 2})  # warm-up
            before = await client.stats()
            tasks = []
            for prompt, prio in work:
                tasks.append(asyncio.ensure_future(client.generate(prompt, params, priority=prio)))
                if interval_ms:
                    await asyncio.sleep(interval_ms / 1000)
            done = await asyncio.gather(*tasks)
            after = await client.stats()
        ttft = {cls: [c.metrics.ttft_s for c, (_, p) in zip(done, work) if p == cls] for cls in (HIGH, LOW)}
        return {
            "ttft_p50_ms": {str(k): 1000 * statistics.median(v) for k, v in ttft.items()},
            "ttft_mean_ms": {str(k): 1000 * statistics.mean(v) for k, v in ttft.items()},
            "e2e_p50_ms": 1000 * statistics.median(c.metrics.e2e_s for c in done),
            "retractions": after.retractions - before.retractions,
            "steps": after.steps - before.steps,
            "integrity": after.integrity,
            "tokens": [c.token_ids for c in done],
        }

    return asyncio.run(go())


def run(cfg: EngineConfig, n: int, input_len: tuple[int, int], output_len: int, high_share: float,
        interval_ms: float, seed: int) -> dict[str, Any]:
    from tandem.protocol.model_info import read_model_info

    work = make_workload(read_model_info(cfg.model).vocab_size, n, input_len, high_share, seed)
    demand = sum(len(p) + output_len for p, _ in work)
    pool = cfg.kv_cache_tokens or demand // 4 // cfg.page_size * cfg.page_size
    longest = max(len(p) for p, _ in work) + output_len
    if pool <= longest:
        raise SystemExit(f"a pool of {pool} tokens can't hold the longest request ({longest}): more requests")
    base = dataclasses.replace(cfg, kv_cache_tokens=pool)
    print(f"priority benchmark, {cfg.model}: {n} requests ({high_share:.0%} high priority), prompts "
          f"{input_len[0]}-{input_len[1]}, {output_len} output tokens; KV demand {demand} tokens = "
          f"{demand / pool:.1f}x the pool of {pool}; load average {os.getloadavg()[0]:.1f}", flush=True)
    runs = {}
    for policy in ("fcfs", "priority"):
        r = runs[policy] = _measure(dataclasses.replace(base, scheduling_policy=policy), work, output_len,
                                    interval_ms)
        t = r["ttft_p50_ms"]
        print(f"  {policy:8s}: TTFT p50 high {t[str(HIGH)]:.0f} ms, low {t[str(LOW)]:.0f} ms "
              f"(ratio {t[str(HIGH)] / t[str(LOW)]:.2f}); e2e p50 {r['e2e_p50_ms']:.0f} ms; "
              f"{r['retractions']} retractions, {r['steps']} steps; integrity {r['integrity']}", flush=True)
    same = sum(a == b for a, b in zip(runs["fcfs"]["tokens"], runs["priority"]["tokens"]))
    p = runs["priority"]["ttft_p50_ms"]
    ratio = p[str(HIGH)] / p[str(LOW)]
    print(f"RESULT priority_high_over_low_ttft_p50={ratio:.2f} outputs_equal={same}/{n}")
    for r in runs.values():
        r.pop("tokens")
    return {
        "benchmark": "priority",
        "model": cfg.model,
        "num_requests": n,
        "input_len": input_len,
        "output_len": output_len,
        "high_share": high_share,
        "interval_ms": interval_ms,
        "kv_demand": demand,
        "kv_pool": pool,
        "runs": runs,
        "high_over_low_ttft_p50": ratio,
        "outputs_equal": same,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tandem.benchmarks.priority_bench",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
    )
    add_engine_flags(p)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-len", default="64:192", help="prompt length range LOW:HIGH")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--high-share", type=float, default=0.25, help="share of high-priority requests")
    p.add_argument("--interval-ms", type=float, default=0.0, help="between sends (0: all at once)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from tandem.benchmarks.workload import parse_range

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.num_requests < 2 or not 0 < args.high_share < 1:
        raise SystemExit("--num-requests >= 2 and --high-share in (0, 1) needed")
    result = run(config_from_args(args), args.num_requests, parse_range(args.input_len), args.output_len,
                 args.high_share, args.interval_ms, args.seed)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

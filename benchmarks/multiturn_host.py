"""Multi-turn conversations on a device KV pool a quarter of their KV: the host tier vs none, one run.

`tandem bench prefix --host-kv-tokens N` runs this instead of the shared-system-prompt benchmark. Each of
C conversations has its own system prompt; every turn all conversations send their whole history (system
prompt, earlier questions and answers) plus a new question at once, and TTFT is measured per request from
submit to first token. The device pool is sized so the conversations' final KV is 4x it, so between turns
a conversation's history is evicted: without a host tier it is recomputed, with one it is copied back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from typing import Any

from protocol.engine_config import EngineConfig


def _measure(cfg: EngineConfig, systems: list[list[int]], questions: list[list[list[int]]], answer_len: int,
             ) -> dict[str, Any]:
    from frontend import AsyncClient
    from protocol import SamplingParams

    params = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)

    async def one(client: Any, prompt: list[int]) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        ttft, out = 0.0, []
        async for d in client.stream(prompt, params):
            if d.token_ids and not out:
                ttft = time.perf_counter() - t0
            out += d.token_ids
        return ttft, out

    async def go() -> dict[str, Any]:
        hist = [list(s) for s in systems]
        ttfts: list[float] = []
        async with AsyncClient.launch(cfg.model, **cfg.options()) as client:
            before = await client.stats()
            t0 = time.perf_counter()
            for turn in range(len(questions[0])):
                prompts = [h + q[turn] for h, q in zip(hist, questions)]
                done = await asyncio.gather(*(one(client, p) for p in prompts))
                for c, (t, out) in enumerate(done):
                    ttfts.append(t)
                    hist[c] = prompts[c] + out
            wall = time.perf_counter() - t0
            after = await client.stats()
        output_tokens = len(ttfts) * answer_len
        return {
            "ttft_mean_ms": 1000 * statistics.mean(ttfts),
            "ttft_median_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * statistics.quantiles(ttfts, n=10)[-1],
            "wall_s": wall,
            "requests_per_s": len(ttfts) / wall,
            "output_tok_s": output_tokens / wall,
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
            "host_hit_tokens": after.host_hit_tokens - before.host_hit_tokens,
            "retractions": after.retractions - before.retractions,
            "steps": after.steps - before.steps,
            "schedule_s": after.schedule_s - before.schedule_s,
            "worker_busy_s": after.worker_busy_s - before.worker_busy_s,
            "integrity": after.integrity,
        }

    return asyncio.run(go())


def run(cfg: EngineConfig, conversations: int, turns: int, system_len: int, question_len: int,
        answer_len: int, seed: int) -> dict[str, Any]:
    from protocol.model_info import read_model_info

    vocab = read_model_info(cfg.model).vocab_size
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(system_len)] for _ in range(conversations)]
    questions = [[[rng.randrange(3, vocab) for _ in range(question_len)] for _ in range(turns)]
                 for _ in range(conversations)]
    total_kv = conversations * (system_len + turns * (question_len + answer_len))
    device = cfg.kv_cache_tokens or total_kv // 4
    longest = system_len + turns * (question_len + answer_len)
    if device <= longest:
        raise SystemExit(f"a device pool of {device} tokens can't hold one conversation of {longest}: "
                         "use more --conversations or a larger --kv-cache-tokens")
    base = dataclasses.replace(cfg, kv_cache_tokens=device, prefix_cache=True)
    host = _measure(base, systems, questions, answer_len)
    none = _measure(dataclasses.replace(base, host_kv_tokens=0), systems, questions, answer_len)
    ratio = none["ttft_mean_ms"] / host["ttft_mean_ms"]
    print(f"multi-turn host KV tier: {conversations} conversations x {turns} turns, system prompt {system_len}, "
          f"question {question_len}, answer {answer_len} tokens; KV {total_kv} tokens = "
          f"{total_kv / device:.1f}x the device pool of {device}; host pool {cfg.host_kv_tokens}")
    for name, r in (("host tier", host), ("no host  ", none)):
        print(f"  {name}: TTFT mean {r['ttft_mean_ms']:.1f} ms, median {r['ttft_median_ms']:.1f} ms, "
              f"p90 {r['ttft_p90_ms']:.1f} ms; {r['requests_per_s']:.2f} req/s, {r['output_tok_s']:.1f} output tok/s; "
              f"prefill {r['prefill_tokens']}, from host {r['host_hit_tokens']}, retractions {r['retractions']}; "
              f"{r['steps']} steps, worker busy {r['worker_busy_s']:.1f} s, scheduling {r['schedule_s']:.1f} s")
    print(f"RESULT ttft_ratio_none_over_host={ratio:.2f}x "
          f"throughput_ratio={host['requests_per_s'] / none['requests_per_s']:.2f}x")
    return {"benchmark": "multiturn_host", "conversations": conversations, "turns": turns,
            "system_len": system_len, "question_len": question_len, "answer_len": answer_len,
            "total_kv_tokens": total_kv, "device_kv_tokens": device, "host_kv_tokens": cfg.host_kv_tokens,
            "host_tier": host, "no_host_tier": none, "ttft_ratio": ratio,
            "throughput_ratio": host["requests_per_s"] / none["requests_per_s"]}

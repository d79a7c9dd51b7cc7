"""Multi-turn chat on a device KV pool a quarter of the conversations' KV: the host tier vs none, one run.

`tandem bench prefix --host-kv-tokens N` (or `--host-kv-memory-gb G`) runs this instead of the
shared-system-prompt benchmark. Each of C conversations has its own long system prompt; each turn sends the
whole history (system prompt, earlier questions and answers) plus a short new question. The users take
turns round-robin (turn t of conversations 0..C-1, then turn t+1, ...), at most `concurrency` requests in
flight: a request is sent as soon as one ends (and its own conversation's previous answer is complete).
So between two turns of one conversation the other C-1 have theirs, and their KV pushes its history out of
the device pool (sized so that all conversations' final KV is 4x it): without a host tier that history is
recomputed, with one it is copied back. TTFT is measured per request, from its own send to its first token.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import statistics
import time
from typing import Any

from tandem.protocol.engine_config import EngineConfig


@dataclasses.dataclass(frozen=True)
class Conversation:
    system: list[int]
    questions: list[list[int]]


def make_conversations(vocab: int, conversations: int, turns: int, system_len: tuple[int, int],
                       question_len: tuple[int, int], seed: int) -> list[Conversation]:
    rng = random.Random(seed)

    def tokens(lengths: tuple[int, int]) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))]

    return [Conversation(tokens(system_len), [tokens(question_len) for _ in range(turns)])
            for _ in range(conversations)]


def final_kv(conv: Conversation, answer_len: int) -> int:
    return len(conv.system) + sum(len(q) + answer_len for q in conv.questions)


def _summary(ttfts: list[float]) -> dict[str, float]:
    return {"mean_ms": 1000 * statistics.mean(ttfts), "median_ms": 1000 * statistics.median(ttfts),
            "p90_ms": 1000 * statistics.quantiles(ttfts, n=10)[-1] if len(ttfts) > 1 else 1000 * ttfts[0]}


def _measure(
    cfg: EngineConfig, convs: list[Conversation], answer_len: int, concurrency: int
) -> dict[str, Any]:
    from tandem import AsyncClient, SamplingParams

    params = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)
    turns = len(convs[0].questions)
    ttfts: list[list[float]] = [[] for _ in range(turns)]  # per turn
    hist = [list(c.system) for c in convs]

    async def one(client: Any, c: int, turn: int, slots: asyncio.Semaphore, done: asyncio.Event) -> None:
        prompt = hist[c] + convs[c].questions[turn]
        t0 = time.perf_counter()
        out: list[int] = []
        async for d in client.stream(prompt, params):
            if d.token_ids and not out:
                ttfts[turn].append(time.perf_counter() - t0)
            out += d.token_ids
        hist[c] = prompt + out
        slots.release()
        done.set()

    async def go() -> dict[str, Any]:
        async with AsyncClient.launch(cfg.model, **cfg.options()) as client:
            before = await client.stats()
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            slots = asyncio.Semaphore(concurrency)
            done: list[asyncio.Event | None] = [None] * len(convs)  # each conversation's latest request
            tasks = []
            for turn in range(turns):
                for c in range(len(convs)):
                    prev = done[c]
                    if prev is not None:
                        await prev.wait()
                    await slots.acquire()
                    done[c] = asyncio.Event()
                    tasks.append(asyncio.create_task(one(client, c, turn, slots, done[c])))
            await asyncio.gather(*tasks)
            wall = time.perf_counter() - t0
            after = await client.stats()
        flat = [t for turn in ttfts for t in turn]
        return {
            "ttft": _summary(flat),
            "ttft_later_turns": _summary([t for turn in ttfts[1:] for t in turn] or flat),
            "ttft_mean_ms_per_turn": [1000 * statistics.mean(t) for t in ttfts],
            "wall_s": wall,
            "requests_per_s": len(flat) / wall,
            "output_tok_s": len(flat) * answer_len / wall,
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
            "host_hit_tokens": after.host_hit_tokens - before.host_hit_tokens,
            "retractions": after.retractions - before.retractions,
            "steps": after.steps - before.steps,
            "schedule_s": after.schedule_s - before.schedule_s,
            "worker_busy_s": after.worker_busy_s - before.worker_busy_s,
            "load_avg_1min": [load0, os.getloadavg()[0]],
            "integrity": after.integrity,
        }

    return asyncio.run(go())


def run(cfg: EngineConfig, conversations: int, turns: int, system_len: tuple[int, int],
        question_len: tuple[int, int], answer_len: int, concurrency: int, seed: int) -> dict[str, Any]:
    import torch

    from tandem.kernels.native.cpu_caps import cpu_caps, usable_cores
    from tandem.protocol.model_info import read_model_info

    convs = make_conversations(read_model_info(cfg.model).vocab_size, conversations, turns, system_len,
                               question_len, seed)
    total_kv = sum(final_kv(c, answer_len) for c in convs)
    longest = max(final_kv(c, answer_len) for c in convs)
    device = cfg.kv_cache_tokens or total_kv // 4 // cfg.page_size * cfg.page_size
    if device <= longest:
        raise SystemExit(f"a device pool of {device} tokens can't hold one conversation of {longest}: "
                         "use more --conversations or a larger --kv-cache-tokens")
    base = dataclasses.replace(cfg, kv_cache_tokens=device, prefix_cache=True)
    cpu = (f"{cpu_caps().describe()}; torch {torch.__version__}, worker threads "
           f"{cfg.torch_threads or usable_cores()}, load average {os.getloadavg()[0]:.1f}")
    print(
        f"multi-turn host KV tier, {cfg.model}: {conversations} conversations x {turns} turns, system prompt "
        f"{system_len[0]}-{system_len[1]}, question {question_len[0]}-{question_len[1]}, answer {answer_len} "
        f"tokens, {concurrency} in flight; KV {total_kv} tokens = {total_kv / device:.1f}x the device pool of "
        f"{device}; host pool {cfg.host_kv_tokens or f'{cfg.host_kv_memory_gb} GB'}"
    )
    print(f"  {cpu}", flush=True)
    host = _measure(base, convs, answer_len, concurrency)
    _report("host tier", host)
    none = _measure(dataclasses.replace(base, host_kv_tokens=0, host_kv_memory_gb=None), convs, answer_len,
                    concurrency)
    _report("no host  ", none)
    ratio = none["ttft"]["mean_ms"] / host["ttft"]["mean_ms"]
    later = none["ttft_later_turns"]["mean_ms"] / host["ttft_later_turns"]["mean_ms"]
    print(f"RESULT ttft_ratio_none_over_host={ratio:.2f}x (turns 2+: {later:.2f}x) "
          f"throughput_ratio={host['requests_per_s'] / none['requests_per_s']:.2f}x")
    return {"benchmark": "multiturn_host", "model": cfg.model, "cpu": cpu, "conversations": conversations,
            "turns": turns, "system_len": system_len, "question_len": question_len, "answer_len": answer_len,
            "concurrency": concurrency, "total_kv_tokens": total_kv, "device_kv_tokens": device,
            "host_kv_tokens": cfg.host_kv_tokens, "host_kv_memory_gb": cfg.host_kv_memory_gb,
            "host_tier": host, "no_host_tier": none, "ttft_ratio": ratio, "ttft_ratio_later_turns": later,
            "throughput_ratio": host["requests_per_s"] / none["requests_per_s"]}


def _report(name: str, r: dict[str, Any]) -> None:
    t, lt = r["ttft"], r["ttft_later_turns"]
    print(
        f"  {name}: TTFT mean {t['mean_ms']:.0f} ms, median {t['median_ms']:.0f} ms, p90 {t['p90_ms']:.0f} "
        f"ms (turns 2+: mean {lt['mean_ms']:.0f} ms); per turn "
        f"{', '.join(f'{m:.0f}' for m in r['ttft_mean_ms_per_turn'])} ms; {r['requests_per_s']:.2f} req/s, "
        f"{r['output_tok_s']:.1f} output tok/s, wall {r['wall_s']:.1f} s; prefill {r['prefill_tokens']}, "
        f"from host {r['host_hit_tokens']}, retractions {r['retractions']}; {r['steps']} steps, worker busy "
        f"{r['worker_busy_s']:.1f} s, scheduling {r['schedule_s']:.1f} s; load avg "
        f"{r['load_avg_1min'][0]:.1f}->{r['load_avg_1min'][1]:.1f}"
    )

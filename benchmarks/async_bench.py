"""Async scheduling on vs off, at several batch sizes, in one run: output tok/s, the scheduler's CPU
time per step, the worker's busy time per step, and the worker's idle gap between steps (the bubble).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from tandem.benchmarks.workload import random_prompts, stats_delta
from tandem.protocol.engine_config import EngineConfig


def _run_mode(cfg: EngineConfig, batches: list[int], prompt_len: tuple[int, int], output_len: int,
              seed: int) -> dict[int, dict[str, float]]:
    from tandem import Client, SamplingParams

    opts = cfg.options()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    out: dict[int, dict[str, float]] = {}
    with Client.launch(cfg.model, **opts) as client:
        client.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for b in batches:
            prompts = random_prompts(cfg.model, b, prompt_len, seed + b)
            before = client.stats()
            t0 = time.perf_counter()
            comps = client.generate_batch(prompts, params, progress=False)
            dt = time.perf_counter() - t0
            s = stats_delta(before, client.stats())
            n = sum(len(c.token_ids) for c in comps)
            step_ms = s["worker_busy_ms_per_step"] + s["worker_idle_ms_per_step"]
            out[b] = {
                "tok_s": n / dt,
                "bubble_pct": 100 * s["worker_idle_ms_per_step"] / step_ms if step_ms else 0,
                **s,
            }
    return out


def run(cfg: EngineConfig, batches: list[int], prompt_len: tuple[int, int], output_len: int,
        seed: int) -> dict[str, Any]:
    on = _run_mode(dataclasses.replace(cfg, async_scheduling=True), batches, prompt_len, output_len, seed)
    off = _run_mode(dataclasses.replace(cfg, async_scheduling=False), batches, prompt_len, output_len, seed)
    print(f"async scheduling on vs off: prompts {prompt_len[0]}:{prompt_len[1]} tokens, output {output_len}")
    print(f"{'batch':>5} {'mode':>5} {'tok/s':>8} {'sched ms/step':>13} {'busy ms/step':>12} "
          f"{'bubble ms/step':>14} {'bubble %':>8}")
    for b in batches:
        for name, r in (("on", on[b]), ("off", off[b])):
            print(f"{b:>5} {name:>5} {r['tok_s']:>8.1f} {r['schedule_ms_per_step']:>13.3f} "
                  f"{r['worker_busy_ms_per_step']:>12.3f} {r['worker_idle_ms_per_step']:>14.3f} "
                  f"{r['bubble_pct']:>7.1f}%")
        print(f"      on/off throughput ratio {on[b]['tok_s'] / off[b]['tok_s']:.2f}x")
    return {"benchmark": "async", "batches": batches, "async_on": on, "async_off": off}

"""Structured output throughput: 0%, 50% and 100% of requests JSON-schema constrained, async scheduling
on vs off, in one run; with the share of constrained outputs that validate against their schema."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from tandem.benchmarks.workload import random_prompts
from tandem.protocol.engine_config import EngineConfig

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _run_mode(
    cfg: EngineConfig, n: int, fractions: list[float], output_len: int, seed: int
) -> dict[str, Any]:
    from tandem import Client, SamplingParams

    opts = cfg.options()
    prompts = random_prompts(cfg.model, n, (16, 64), seed)
    out: dict[str, Any] = {}
    with Client.launch(cfg.model, **opts) as client:
        client.generate([5, 6], SamplingParams(max_tokens=8, json_schema=SCHEMA))  # warm-up, compiles
        for frac in fractions:
            k = round(n * frac)
            params = [SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, json_schema=SCHEMA)
                      if i < k else SamplingParams(max_tokens=output_len // 2, temperature=1.0, seed=i,
                                                   ignore_eos=True) for i in range(n)]
            t0 = time.perf_counter()
            comps = client.generate_batch(prompts, params, progress=False)
            dt = time.perf_counter() - t0
            toks = sum(len(c.token_ids) for c in comps)
            valid = sum(_valid(c.text) for c in comps[:k])
            out[f"{int(frac * 100)}%"] = {"tok_s": toks / dt, "output_tokens": toks, "constrained": k,
                                          "valid": valid, "validity": valid / k if k else None}
    return out


def run(cfg: EngineConfig, n: int, output_len: int, seed: int) -> dict[str, Any]:
    fractions = [0.0, 0.5, 1.0]
    on = _run_mode(dataclasses.replace(cfg, async_scheduling=True), n, fractions, output_len, seed)
    off = _run_mode(dataclasses.replace(cfg, async_scheduling=False), n, fractions, output_len, seed)
    print(f"structured output: {n} requests, JSON schema constrained share 0/50/100%")
    print(f"{'share':>6} {'mode':>5} {'tok/s':>8} {'valid':>12}")
    for key in on:
        for name, r in (("on", on[key]), ("off", off[key])):
            v = f"{r['valid']}/{r['constrained']}" if r["constrained"] else "-"
            print(f"{key:>6} {name:>5} {r['tok_s']:>8.1f} {v:>12}")
        print(f"       async on/off throughput ratio {on[key]['tok_s'] / off[key]['tok_s']:.2f}x")
    return {"benchmark": "structured", "num_requests": n, "async_on": on, "async_off": off}

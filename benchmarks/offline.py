"""Offline throughput: every prompt submitted at once, engine vs transformers `generate`, vs the roofline."""
from __future__ import annotations

import time
from typing import Any

import torch

from tandem.benchmarks import roofline
from tandem.benchmarks.workload import format_stats, load_hf_model, random_prompts, stats_delta
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.sampling_params import SamplingParams

DECODE_BATCH = 64  # the roofline's decode group: at most this many requests decode together


def run_engine(cfg: EngineConfig, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from tandem import Client

    opts = cfg.options()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with Client.launch(cfg.model, **opts) as client:
        # Warm-up outside the timed section: first-call allocations, thread pools, kernel selection.
        client.generate(prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        before = client.stats()
        start = time.perf_counter()
        outs = client.generate_batch(prompts, params, progress=False)
        elapsed = time.perf_counter() - start
        after = client.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    reported = sum(o.completion_tokens for o in outs)
    if tokens != reported:
        raise RuntimeError(f"engine streamed {tokens} tokens but reported {reported} completion tokens")
    return {"seconds": elapsed, "output_tokens": tokens, "stats": stats_delta(before, after)}


@torch.inference_mode()
def run_transformers(
    model_dir: str, prompts: list[list[int]], output_len: int, batch_size: int
) -> dict[str, Any]:
    model = load_hf_model(model_dir)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # Length-sorted batches waste the least on padding: the strongest simple use of `generate`.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [[prompts[i] for i in order[j : j + batch_size]] for j in range(0, len(order), batch_size)]
    gen_kw = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False,
              "pad_token_id": pad}
    ids, mask = _left_pad([p[:8] for p in batches[0][:2]], pad)
    model.generate(input_ids=ids, attention_mask=mask, **{**gen_kw, "max_new_tokens": 2, "min_new_tokens": 2})
    tokens = 0
    start = time.perf_counter()
    for batch in batches:
        ids, mask = _left_pad(batch, pad)
        out = model.generate(input_ids=ids, attention_mask=mask, **gen_kw)
        new = out[:, ids.shape[1] :]
        # min_new_tokens masks EOS until output_len, so no row stops (or pads) early; check it anyway.
        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if new.shape[1] != output_len or any(bool((new == e).any()) for e in eos_ids):
            raise RuntimeError(
                f"transformers produced {new.shape[1]} new tokens (or an EOS), not {output_len}"
            )
        tokens += new.numel()
    return {"seconds": time.perf_counter() - start, "output_tokens": tokens}


def _left_pad(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def run(cfg: EngineConfig, num_requests: int, input_len: tuple[int, int], output_len: int, seed: int,
        hf_batch_size: int, skip_baseline: bool) -> dict[str, Any]:
    prompts = random_prompts(cfg.model, num_requests, input_len, seed)
    lens = [len(p) for p in prompts]
    expected = num_requests * output_len
    print(
        f"offline: {num_requests} requests, prompt {input_len[0]}:{input_len[1]} tokens (total {sum(lens)}), "
        f"output {output_len} each (total {expected}), seed {seed}",
        flush=True,
    )

    dims = roofline.model_dims(cfg)
    decode_m = min(num_requests, cfg.max_running_requests, DECODE_BATCH)
    mach = roofline.measure(dims, prefill_m=cfg.max_num_batched_tokens, decode_m=decode_m)
    floor = roofline.offline_floor(dims, mach, lens, output_len)
    print(roofline.describe(mach), flush=True)

    eng = run_engine(cfg, prompts, output_len)
    if eng["output_tokens"] != expected:
        raise RuntimeError(f"engine produced {eng['output_tokens']} output tokens, expected {expected}")
    engine_tok_s = eng["output_tokens"] / eng["seconds"]
    print(
        f"engine: {eng['output_tokens']} tokens in {eng['seconds']:.2f} s = {engine_tok_s:.1f} tok/s",
        flush=True,
    )
    print("  " + format_stats(eng["stats"]), flush=True)

    base: dict[str, Any] | None = None
    if not skip_baseline:
        base = run_transformers(cfg.model, prompts, output_len, hf_batch_size)
        base["tok_s"] = base["output_tokens"] / base["seconds"]
        print(
            f"transformers generate (fp32, batch {hf_batch_size}, left-padded, length-sorted): "
            f"{base['output_tokens']} tokens in {base['seconds']:.2f} s = {base['tok_s']:.1f} tok/s",
            flush=True,
        )

    result: dict[str, Any] = {
        "benchmark": "offline",
        "model": cfg.model,
        "num_requests": num_requests,
        "input_len": list(input_len),
        "output_len": output_len,
        "seed": seed,
        "prompt_tokens": sum(lens),
        "expected_output_tokens": expected,
        "engine_output_tokens": eng["output_tokens"],
        "engine_s": eng["seconds"],
        "engine_tok_s": engine_tok_s,
        "baseline_output_tokens": base["output_tokens"] if base else None,
        "baseline_s": base["seconds"] if base else None,
        "baseline_tok_s": base["tok_s"] if base else None,
        "ratio": engine_tok_s / base["tok_s"] if base else None,
        "roofline_tok_s": floor.tok_s,
        "roofline_fraction": engine_tok_s / floor.tok_s,
        "roofline_prefill_s": floor.prefill_s,
        "roofline_decode_s": floor.decode_s,
        "machine": roofline.machine_dict(mach),
        "engine_stats": eng["stats"],
        "engine_options": cfg.options(),
    }
    print(f"roofline floor: prefill {floor.prefill_s:.3f} s + decode {floor.decode_s:.3f} s "
          f"= {floor.total_s:.3f} s -> {floor.tok_s:.1f} tok/s")
    ratio = f"{result['ratio']:.2f}x" if base else "n/a (--skip-baseline)"
    print(f"RESULT engine_tok_s={engine_tok_s:.1f} baseline_tok_s="
          f"{base['tok_s'] if base else float('nan'):.1f} ratio={ratio} roofline_tok_s={floor.tok_s:.1f} "
          f"roofline_fraction={result['roofline_fraction']:.3f}", flush=True)
    return result

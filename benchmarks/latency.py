"""Latency: one request at a time through the whole stack (TTFT, decode tok/s) vs transformers batch 1."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem.benchmarks import roofline
from tandem.benchmarks.llama_cpp import llama_bench
from tandem.benchmarks.workload import format_stats, load_hf_model, random_prompts, stats_delta
from tandem.kernels.native.cpu_caps import usable_cores
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.gguf_metadata import is_gguf
from tandem.protocol.sampling_params import SamplingParams


def run_engine(cfg: EngineConfig, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from tandem import Client

    opts = cfg.options()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    decode_rates: list[float] = []
    tokens: list[int] = []
    with Client.launch(cfg.model, **opts) as client:
        # warm-up
        client.generate(prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        before = client.stats()
        for prompt in prompts:
            n = n_first = 0
            first = None
            start = time.perf_counter()  # stream() is a generator: the submit happens on the first next()
            for delta in client.stream(prompt, params):
                if delta.token_ids and first is None:
                    first, n_first = time.perf_counter(), len(delta.token_ids)
                n += len(delta.token_ids)
            end = time.perf_counter()
            if first is None or n != output_len:
                raise RuntimeError(f"engine streamed {n} tokens, expected {output_len}")
            ttfts.append(first - start)
            # Tokens after the first delta over the time after it (a delta normally holds one token).
            decode_rates.append((n - n_first) / (end - first) if n > n_first else float("nan"))
            tokens.append(n)
        after = client.stats()
    return {
        "ttft_s": ttfts, "decode_tok_s": decode_rates, "output_tokens": tokens,
        "stats": stats_delta(before, after),
    }


@torch.inference_mode()
def run_transformers(model_dir: str, prompt: list[int], output_len: int, repeats: int) -> list[float]:
    """Batch-1 greedy decode tok/s: (output_len - 1) / (full generate - 1-token generate), per repeat."""
    model = load_hf_model(model_dir)
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    pad = model.generation_config.pad_token_id

    def gen(n: int) -> float:
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
        if out.shape[1] - ids.shape[1] != n:
            raise RuntimeError(f"transformers produced {out.shape[1] - ids.shape[1]} tokens, not {n}")
        return elapsed

    gen(4)  # warm-up
    rates: list[float] = []
    for _ in range(repeats):
        prefill = gen(1)  # the prefill and its one token: what the full run spends before decoding
        total = gen(output_len)
        rates.append((output_len - 1) / (total - prefill))
    return rates


def run(cfg: EngineConfig, prompt_len: int, output_len: int, num_requests: int, seed: int,
        skip_baseline: bool, llama_cpp: Path | None = None, llama_cpp_args: tuple[str, ...] = (),
        llama_cpp_model: str | None = None) -> dict[str, Any]:
    if output_len < 2:
        raise ValueError("--output-len must be >= 2 to measure decode speed")
    anchor = llama_cpp_model or cfg.model
    if llama_cpp is not None and not is_gguf(anchor):
        raise SystemExit("--llama-cpp needs a .gguf: --model FILE.gguf, or --llama-cpp-model FILE.gguf")
    prompts = random_prompts(cfg.model, num_requests, (prompt_len, prompt_len), seed)
    print(f"latency: {num_requests} sequential requests, prompt {prompt_len} tokens, output {output_len}, "
          f"seed {seed}", flush=True)

    dims = roofline.model_dims(cfg)
    # GEMM rates are not needed for a bandwidth bound; measure small shapes quickly, report the copy rate.
    mach = roofline.measure(dims, prefill_m=prompt_len, decode_m=1, min_time_s=0.05)
    floor_tok_s = roofline.batch1_decode_floor_tok_s(dims, mach, prompt_len, output_len)
    print(roofline.describe(mach), flush=True)

    eng = run_engine(cfg, prompts, output_len)
    ttft_ms = statistics.median(eng["ttft_s"]) * 1000
    decode = statistics.median(eng["decode_tok_s"])
    print(
        f"engine: TTFT median {ttft_ms:.1f} ms [{', '.join(f'{t * 1000:.1f}' for t in eng['ttft_s'])}], "
        f"decode median {decode:.1f} tok/s [{', '.join(f'{r:.1f}' for r in eng['decode_tok_s'])}]",
        flush=True,
    )
    print("  " + format_stats(eng["stats"]), flush=True)

    base: list[float] | None = None
    if not skip_baseline:
        base = run_transformers(cfg.model, prompts[0], output_len, num_requests)
        print(f"transformers generate batch 1 (fp32): decode median {statistics.median(base):.1f} tok/s "
              f"[{', '.join(f'{r:.1f}' for r in base)}]", flush=True)
    base_med = statistics.median(base) if base else None
    llama = None
    if llama_cpp is not None:
        llama = llama_bench(llama_cpp, anchor, 0, output_len, cfg.torch_threads or usable_cores(),
                            extra=llama_cpp_args, both_layouts=True)
        print(f"llama.cpp ({llama['build']}) llama-bench tg{output_len} on {anchor}: {llama['tg_tok_s']:.1f} "
              f"± {llama['tg_std']:.1f} tok/s ({'repacked' if llama['repack'] else 'the file'}'s layout, "
              "its faster)", flush=True)

    result: dict[str, Any] = {
        "benchmark": "latency",
        "model": cfg.model,
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "seed": seed,
        "expected_output_tokens": num_requests * output_len,
        "engine_output_tokens": sum(eng["output_tokens"]),
        "engine_ttft_ms": ttft_ms,
        "engine_ttft_ms_all": [t * 1000 for t in eng["ttft_s"]],
        "engine_decode_tok_s": decode,
        "engine_decode_tok_s_all": eng["decode_tok_s"],
        "baseline_decode_tok_s": base_med,
        "baseline_decode_tok_s_all": base,
        "ratio": decode / base_med if base_med else None,
        "llama_cpp": llama,
        "llama_cpp_model": anchor if llama_cpp is not None else None,
        "ratio_vs_llama_cpp": decode / llama["tg_tok_s"] if llama and llama["tg_tok_s"] else None,
        "roofline_decode_tok_s": floor_tok_s,
        "roofline_fraction": decode / floor_tok_s,
        "weight_bytes": dims.weight_bytes,
        "machine": roofline.machine_dict(mach),
        "engine_stats": eng["stats"],
        "engine_options": cfg.options(),
    }
    print(f"memory roofline, batch-1 decode: ({dims.weight_bytes / 1e6:.1f} MB weights + KV) / "
          f"{mach.bandwidth_gbs:.1f} GB/s -> {floor_tok_s:.1f} tok/s")
    ratio = f"{result['ratio']:.2f}x" if base_med else "n/a (--skip-baseline)"
    print(
        f"RESULT engine_ttft_ms={ttft_ms:.1f} engine_decode_tok_s={decode:.1f} baseline_decode_tok_s="
        f"{base_med if base_med else float('nan'):.1f} ratio={ratio} roofline_decode_tok_s={floor_tok_s:.1f} "
        f"roofline_fraction={result['roofline_fraction']:.3f}",
        flush=True,
    )
    if llama is not None:
        print(f"RESULT_LLAMA_CPP llama_cpp_tg_tok_s={llama['tg_tok_s']:.1f} engine_decode_tok_s={decode:.1f} "
              f"ratio_vs_llama_cpp={result['ratio_vs_llama_cpp']:.2f}x", flush=True)
    return result

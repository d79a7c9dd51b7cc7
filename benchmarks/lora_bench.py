"""`tandem bench lora`: output tok/s of concurrent streams spread over LoRA adapters against the same streams
on the base model, and one stream's decode with an adapter against without, in one engine, one run:

    tandem bench lora --model DIR [--adapters 4] [--rank 16] [--streams 32] [--output-len 64] [--runs 3]

The adapters are random (PEFT's layout and names, every attention and MLP projection targeted), loaded while
serving (`load_lora`); the two workloads alternate, run after run, and medians are reported with `lscpu`.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.kernels.native.cpu_caps import usable_cores
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.gguf_metadata import is_gguf
from tandem.protocol.lora import TARGETS, target_dims
from tandem.protocol.model_config import read_model_config


def write_adapter(model: str, out: Path, rank: int, seed: int) -> Path:
    """A random adapter of `rank` for `model` in PEFT's files (B not zero, as a trained one's)."""
    cfg = read_model_config(model)
    dims = target_dims(cfg)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_hidden_layers):
        for t in TARGETS:
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{t}"
            fan_in, fan_out = dims[t]
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            weights[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "base_model_name_or_path": model}))
    return out


async def _streams(client: Any, prompts: list[list[int]], loras: list[str | None], output_len: int) -> float:
    """Output tok/s of all the streams at once."""
    params = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(client.generate(p, params, lora=n) for p, n in zip(prompts, loras)))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


async def _decode(client: Any, prompt: list[int], lora: str | None, output_len: int) -> float:
    """One stream's decode tok/s (after its first token)."""
    params = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    first = last = None
    n = 0
    async for d in client.stream(prompt, params, lora=lora):
        if d.token_ids:
            now = time.perf_counter()
            first = first or now
            last, n = now, n + len(d.token_ids)
    assert first is not None and last is not None
    return (n - 1) / (last - first)


async def _run(cfg: EngineConfig, adapters: int, rank: int, streams: int, prompt_len: int, output_len: int,
               runs: int, tmp: Path) -> dict[str, Any]:
    from tandem import AsyncClient

    options = {f: getattr(cfg, f) for f in ("dtype", "max_running_requests", "max_num_batched_tokens")}
    names = [f"adapter-{i}" for i in range(adapters)]
    g = torch.Generator().manual_seed(cfg.seed)
    top = min(5000, read_model_config(cfg.model).vocab_size)
    prompts = [torch.randint(10, top, (prompt_len,), generator=g).tolist() for _ in range(streams)]
    spread: list[str | None] = [names[i % adapters] for i in range(streams)]
    res: dict[str, list[float]] = {"base": [], "adapters": [], "decode_base": [], "decode_adapter": []}
    # the slots as wide as --max-lora-rank says (64 unless told): an adapter of a lower rank in a wider slot
    async with AsyncClient.launch(cfg.model, enable_lora=True, max_loras=adapters,
                                  max_lora_rank=max(rank, cfg.max_lora_rank),
                                  **options) as c:
        for i, n in enumerate(names):
            await c.load_lora(n, str(write_adapter(cfg.model, tmp / n, rank, seed=i)))
        await _streams(c, prompts, spread, 8)  # warm-up: every adapter in its slot
        await _streams(c, prompts, [None] * streams, 8)
        for _ in range(runs):
            res["base"].append(await _streams(c, prompts, [None] * streams, output_len))
            res["adapters"].append(await _streams(c, prompts, spread, output_len))
            res["decode_base"].append(await _decode(c, prompts[0], None, output_len))
            res["decode_adapter"].append(await _decode(c, prompts[0], names[0], output_len))
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"runs": res, "median": med, "streams_ratio": med["adapters"] / med["base"],
            "decode_ratio": med["decode_adapter"] / med["decode_base"], "prompt": prompts[0]}


def run(cfg: EngineConfig, adapters: int, rank: int, streams: int, prompt_len: int, output_len: int, runs: int,
        out: Path | None = None, llama_cpp: Path | None = None) -> dict[str, Any]:
    """llama_cpp: a llama.cpp build, for its server's figures with the first adapter on the same .gguf
    (benchmarks/lora_llama_cpp.py), run after tandem's engine has stopped."""
    if llama_cpp is not None and not is_gguf(cfg.model):
        raise SystemExit("--llama-cpp needs a .gguf --model (llama.cpp runs the same file)")
    with tempfile.TemporaryDirectory() as tmp:
        r = asyncio.run(_run(cfg, adapters, rank, streams, prompt_len, output_len, runs, Path(tmp)))
        prompt = r.pop("prompt")
        if llama_cpp is not None:
            from tandem.benchmarks.lora_llama_cpp import llama_cpp_decode

            r["llama_cpp"] = llama_cpp_decode(llama_cpp, cfg.model, Path(tmp) / "adapter-0", prompt, output_len,
                                              runs, cfg.torch_threads or usable_cores(), Path(tmp))
    m = r["median"]
    lines = [
        f"model {cfg.model}, {adapters} adapters of rank {rank} (--max-lora-rank "
        f"{max(rank, cfg.max_lora_rank)}), prompts of {prompt_len}, {output_len} tokens out, median of {runs}",
        "",
        "| figure | with adapters | base alone | ratio |",
        "|---|---|---|---|",
        f"| {streams} streams, output tok/s (spread over the adapters) | {m['adapters']:.1f} | {m['base']:.1f} "
        f"| {r['streams_ratio']:.2f} |",
        f"| 1 stream, decode tok/s (one adapter) | {m['decode_adapter']:.1f} | {m['decode_base']:.1f} | "
        f"{r['decode_ratio']:.2f} |",
    ]
    if "llama_cpp" in r:
        lm = r["llama_cpp"]["median"]
        lines += [
            f"| 1 stream, llama.cpp's llama-server on the same file (the first adapter, its own converter) | "
            f"{lm['decode_adapter']:.1f} | {lm['decode_base']:.1f} | {r['llama_cpp']['decode_ratio']:.2f} |",
            "",
            f"tandem / llama.cpp, 1 stream decode: with the adapter {m['decode_adapter'] / lm['decode_adapter']:.2f}x,"
            f" the base {m['decode_base'] / lm['decode_base']:.2f}x",
        ]
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    text = "\n".join(lines) + f"\n\n```\n{cpu}```\n"
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    return r

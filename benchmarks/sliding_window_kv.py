"""KV a long request holds with sliding-window freeing (the sliding layers' own pool: what every window has
left behind goes back as the request grows) against the same request without it (--no-sliding-window-kv:
every layer keeps every position), in-process: the real Scheduler and ModelRunner, step by step.

Before and after every step it counts the slots in use in each pool (pool size - free): the step's new
slots handed out, then what every window has left behind given back. It turns them into bytes: a
full slot holds one position's K and V in each layer that keeps it there (all layers without freeing, the
global ones with it), a sliding slot in each sliding layer. Reports the peak and the end of the request, and
checks that both runs gave the same tokens.

    python -m tandem.benchmarks.sliding_window_kv --model models/gemma3-270m [--prompt-tokens 4000] [--json
    out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from tandem.kernels.native.cpu_caps import cpu_caps
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import TokenBatch, TokenizedRequest
from tandem.protocol.model_config import read_model_config
from tandem.protocol.model_info import read_model_info
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tandem.worker.memory import kv_bytes_per_token
from tandem.worker.model_runner import ModelRunner


def prompt_ids(model: str, n: int) -> list[int]:
    """n tokens of the corpus the repo ships (repeated as needed), BOS first when the tokenizer adds one."""
    from tandem.launch.tokenizer_maker import CORPUS_PATH
    from tandem.protocol.tokenizer_loader import load_tokenizer

    # ~n tokens or more
    ids = load_tokenizer(model)(CORPUS_PATH.read_text(encoding="utf-8")[: 8 * n]).input_ids
    while len(ids) < n:
        ids += ids[1:]
    return ids[:n]


def run(cfg: EngineConfig, ids: list[int], max_tokens: int) -> dict[str, Any]:
    info = read_model_info(cfg.model)
    runner = ModelRunner(cfg, info)
    sched = Scheduler(cfg, info, runner.num_kv_slots, num_swa_slots=runner.num_swa_slots)
    mc = runner.model.config
    sliding = sum(map(mc.is_sliding, range(mc.num_hidden_layers)))
    own = runner.num_swa_slots > 0
    per_full = kv_bytes_per_token(
        mc, runner.kv_dtype, cfg.tp_size, mc.num_hidden_layers - (sliding if own else 0)
    )
    per_swa = kv_bytes_per_token(mc, runner.kv_dtype, cfg.tp_size, sliding)
    sched.add_request(
        TokenizedRequest("r", ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    )
    kv, trace, tokens = sched.kv, [], []
    t0 = time.perf_counter()

    def sample() -> None:
        full = kv.allocator.size - kv.allocator.num_free
        swa = kv.hybrid.swa.size - kv.hybrid.swa.num_free if kv.hybrid is not None else 0
        if sched.running:  # while the request runs (after it, the prefix cache holds what it kept)
            trace.append((full, swa, full * per_full + swa * per_swa))

    while sched.has_work:
        so = sched.schedule()
        if so is None:
            break
        sample()  # the step's slots handed out: the most it holds
        sched.commit(runner.execute(so))
        for msg in sched.take_outbox():
            if isinstance(msg, TokenBatch):
                tokens += [t for d in msg.deltas for t in d.token_ids]
        sample()  # what the window left behind given back
    peak = max(trace, key=lambda t: t[2])
    return {
        "sliding_window_kv": own,
        "full_slots_peak": peak[0],
        "sliding_slots_peak": peak[1],
        "kv_bytes_peak": peak[2],
        "kv_bytes_end": trace[-1][2],
        "bytes_per_full_slot": per_full,
        "bytes_per_sliding_slot": per_swa,
        "pool_slots": runner.num_kv_slots,
        "sliding_pool_slots": runner.num_swa_slots,
        "seconds": time.perf_counter() - t0,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", required=True, help="a model with sliding-window layers (directory or .gguf)")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-tokens")
    ap.add_argument("--random-prompt", action="store_true", help="random token ids instead of the corpus")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    if not read_model_config(args.model).has_sliding_layers:
        ap.error(f"{args.model} has no sliding-window layers")
    n = args.prompt_tokens
    ids = ([random.Random(0).randrange(3, 1000) for _ in range(n)] if args.random_prompt
           else prompt_ids(args.model, n))
    runs = {}
    for own in (True, False):
        cfg = EngineConfig(
            model=args.model,
            dtype="float32",
            kv_cache_tokens=n + args.max_tokens + 64,
            max_running_requests=4,
            max_num_batched_tokens=args.chunk,
            chunked_prefill_tokens=args.chunk,
            sliding_window_kv=own,
        )
        runs["with" if own else "without"] = run(cfg, ids, args.max_tokens)
    same = runs["with"].pop("tokens") == runs["without"].pop("tokens")
    result = {
        "model": args.model,
        "prompt_tokens": n,
        "max_tokens": args.max_tokens,
        "same_tokens": same,
        "window": read_model_info(args.model).sliding_window,
        "cpu": cpu_caps().model,
        "threads": torch.get_num_threads(),
        **{f"{k}_{side}": v for side, r in runs.items() for k, v in r.items()},
    }
    result["kv_peak_ratio"] = result["kv_bytes_peak_with"] / result["kv_bytes_peak_without"]
    mib = 1 << 20
    print(f"{n}-token request, {args.max_tokens} tokens out, window {result['window']}: KV in use at peak "
          f"{result['kv_bytes_peak_with'] / mib:.1f} MiB with sliding-window freeing, "
          f"{result['kv_bytes_peak_without'] / mib:.1f} MiB without ({result['kv_peak_ratio']:.3f}x); "
          f"same tokens: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Attention alone, backend against backend, on KV laid out the way the engine's allocator lays it out.

One step's attention over every layer for a batch of requests: each prompt's slots in one block
(handed out highest slot first), then `--decoded` decode tokens per request with slots interleaved
across the batch (one slot per request per step). The step's queries are each request's last
`--new-tokens` positions: 1 (default) is a decode step; as many as the prompt, with `--decoded 0`, is a
prefill of every prompt. `--kv-dtypes` runs each backend on a pool of each KV dtype (the same values,
rounded or quantized to q8_0 blocks), as `--kv-cache-dtype` stores it. Backends and pools run in turn, repeatedly, and the fastest
repeat of each is reported, so a noisy neighbour on a shared machine hits them alike.

    python -m tandem.benchmarks.attention_step --model models/bench-llama [--batch 64 --decoded 64]
    python -m tandem.benchmarks.attention_step --model models/bench-llama --batch 8 --decoded 0 --new-tokens
    512
    python -m tandem.benchmarks.attention_step --model models/bench-llama --backends cpu --kv-dtypes
    float32,float16
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from tandem.benchmarks.roofline import ModelDims
from tandem.kernels.native.cpu_caps import cpu_caps
from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.kv_quant import dtype_name, to_pool
from tandem.worker.attention_backend import AttentionBackend, select_attention_backend
from tandem.worker.device import resolve_kv_dtype
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Prints each backend's best step time per KV dtype; returns them in ms by "backend" (a float32 pool) or
    "backend/kvdtype"."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", default="64:512")
    ap.add_argument("--decoded", type=int, default=64, help="tokens each request has decoded so far")
    ap.add_argument("--new-tokens", type=int, default=1, help="queries per request: its last N positions")
    ap.add_argument("--backends", default="torch,cpu")
    ap.add_argument("--kv-dtypes", default="float32", help="KV pool dtypes, e.g. float32,float16,bfloat16,q8_0")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = ModelDims.from_dir(args.model)
    rng = random.Random(args.seed)
    lo, _, hi = args.input_len.partition(":")
    prompts = [rng.randint(int(lo), int(hi or lo)) for _ in range(args.batch)]
    num_slots = sum(prompts) + args.batch * (args.decoded + 1) + 1
    kv_dtypes = [resolve_kv_dtype(name, torch.float32, torch.device("cpu")) for name in args.kv_dtypes.split(",")]
    kvs = [KVCache(dims.layers, num_slots, dims.kv_heads, dims.head_dim, dt, "cpu",
                   max_reqs=args.batch, max_context=max(prompts) + args.decoded + 1) for dt in kv_dtypes]
    for layers in zip(*(kv.k + kv.v for kv in kvs)):
        values = torch.randn(layers[0].shape[0], dims.kv_heads, dims.head_dim)
        for t in layers:
            t.copy_(to_pool(values, t.dtype))  # each pool the same values, rounded or quantized
    top = num_slots - 1
    seqs: list[list[int]] = []
    for n in prompts:  # prompt blocks, highest slot first, as KVAllocator.alloc hands them out
        seqs.append(list(range(top, top - n, -1)))
        top -= n
    for _ in range(args.decoded + 1):  # then one slot per request per decode step
        for s in seqs:
            s.append(top)
            top -= 1
    for row, s in enumerate(seqs):
        for pool in kvs:
            pool.req_to_token[row, : len(s)] = torch.tensor(s)
    lens = [len(s) for s in seqs]
    if args.new_tokens < 1:
        raise SystemExit("--new-tokens must be at least 1")
    new = [min(args.new_tokens, n) for n in lens]
    locs = [slot for s, e in zip(seqs, new) for slot in s[len(s) - e :]]
    batch = ForwardBatch.from_lists([0] * len(locs), locs, list(range(args.batch)), lens, new)
    q = torch.randn(len(locs), dims.heads, dims.head_dim)
    k = torch.randn(len(locs), dims.kv_heads, dims.head_dim)
    print(cpu_caps().describe())
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}; {args.model}: {dims.layers} layers, "
        f"{dims.heads}/{dims.kv_heads} heads x {dims.head_dim}; batch {args.batch}, "
        f"mean context {sum(lens) / len(lens):.0f}, {len(locs)} queries"
    )
    names = args.backends.split(",")
    backends = [select_attention_backend(resolve_ops("cpu", torch.float32, name)) for name in names]

    def label(b: AttentionBackend, pool: KVCache) -> str:
        return b.name + ("" if pool.dtype == torch.float32 else f"/{dtype_name(pool.dtype)}")

    runs = [(label(b, pool), b, pool) for pool in kvs for b in backends]
    best = {name: float("inf") for name, _, _ in runs}
    scale = dims.head_dim**-0.5
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, b, pool in runs:
                t0 = time.perf_counter()
                plan = b.plan(batch, pool)
                for layer in range(dims.layers):
                    b.forward(layer, q, k, k, pool, plan, scale)
                best[name] = min(best[name], time.perf_counter() - t0)
        # A faster wrong answer is no result: every backend must compute what the first one does on the same
        # pool (the step's K/V were just written to each pool, rounded to its dtype), and a rounded pool about
        # what the first pool gives (bf16's 8 significant bits on unit-sized values: within a few 1e-2).
        first_out = None
        for pool in kvs:
            want = backends[0].forward(0, q, k, k, pool, backends[0].plan(batch, pool), scale)
            first_out = want if first_out is None else first_out
            checks = [(label(b, pool), b.forward(0, q, k, k, pool, b.plan(batch, pool), scale), 1e-5)
                      for b in backends[1:]]
            for other, got, tol in [*checks, (runs[0][0], first_out, 5e-2)]:
                if not torch.allclose(got, want, atol=tol, rtol=10 * tol):
                    raise SystemExit(f"{label(backends[0], pool)} differs from {other} by "
                                     f"{(got - want).abs().max():.3g}")
    first = runs[0][0]
    for name, t in best.items():
        print(f"{name:>22}: {1000 * t:8.2f} ms per step (all layers), {best[first] / t:.2f}x {first}")
    return {name: 1000 * t for name, t in best.items()}


if __name__ == "__main__":
    main()

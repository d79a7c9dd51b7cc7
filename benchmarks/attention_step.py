"""Attention alone, backend against backend, on KV laid out the way the engine's allocator lays it out.

One step's attention over every layer for a batch of requests: each prompt's slots in one block
(handed out highest slot first), then `--decoded` decode tokens per request with slots interleaved
across the batch (one slot per request per step). The step's queries are each request's last
`--new-tokens` positions: 1 (default) is a decode step; as many as the prompt, with `--decoded 0`, is a
prefill of every prompt. Backends run in turn, repeatedly, and the fastest repeat of each is reported, so
a noisy neighbour on a shared machine hits them alike.

    python -m benchmarks.attention_step --model models/bench-llama [--batch 64 --decoded 64]
    python -m benchmarks.attention_step --model models/bench-llama --batch 8 --decoded 0 --new-tokens 512
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.roofline import ModelDims
from kernels.native.cpu_caps import cpu_caps
from kernels.ops import resolve_ops
from worker.attention_backend import select_attention_backend
from worker.forward_batch import ForwardBatch
from worker.kv_cache import KVCache


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Prints each backend's best step time; returns them in ms by backend name."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", default="64:512")
    ap.add_argument("--decoded", type=int, default=64, help="tokens each request has decoded so far")
    ap.add_argument("--new-tokens", type=int, default=1, help="queries per request: its last N positions")
    ap.add_argument("--backends", default="torch,cpu")
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
    kv = KVCache(dims.layers, num_slots, dims.kv_heads, dims.head_dim, torch.float32, "cpu",
                 max_reqs=args.batch, max_context=max(prompts) + args.decoded + 1)
    for t in kv.k + kv.v:
        t.normal_()
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
        kv.req_to_token[row, : len(s)] = torch.tensor(s)
    lens = [len(s) for s in seqs]
    if args.new_tokens < 1:
        raise SystemExit("--new-tokens must be at least 1")
    new = [min(args.new_tokens, n) for n in lens]
    locs = [slot for s, e in zip(seqs, new) for slot in s[len(s) - e :]]
    batch = ForwardBatch.from_lists([0] * len(locs), locs, list(range(args.batch)), lens, new)
    q = torch.randn(len(locs), dims.heads, dims.head_dim)
    k = torch.randn(len(locs), dims.kv_heads, dims.head_dim)
    print(cpu_caps().describe())
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; {args.model}: {dims.layers} layers, "
          f"{dims.heads}/{dims.kv_heads} heads x {dims.head_dim}; batch {args.batch}, "
          f"mean context {sum(lens) / len(lens):.0f}, {len(locs)} queries")
    names = args.backends.split(",")
    backends = [select_attention_backend(resolve_ops("cpu", torch.float32, name)) for name in names]
    best = {b.name: float("inf") for b in backends}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for b in backends:
                t0 = time.perf_counter()
                plan = b.plan(batch, kv)
                for layer in range(dims.layers):
                    b.forward(layer, q, k, k, kv, plan, dims.head_dim**-0.5)
                best[b.name] = min(best[b.name], time.perf_counter() - t0)
        # A faster wrong answer is no result: every backend must compute what the first one does.
        want = backends[0].forward(0, q, k, k, kv, backends[0].plan(batch, kv), dims.head_dim**-0.5)
        for b in backends[1:]:
            got = b.forward(0, q, k, k, kv, b.plan(batch, kv), dims.head_dim**-0.5)
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
                raise SystemExit(f"{b.name} differs from {backends[0].name} by {(got - want).abs().max():.3g}")
    base = best[backends[0].name]
    for name, t in best.items():
        print(f"{name:>14}: {1000 * t:8.1f} ms per step (all layers), {base / t:.2f}x {backends[0].name}")
    return {name: 1000 * t for name, t in best.items()}


if __name__ == "__main__":
    main()

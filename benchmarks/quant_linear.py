"""A GGUF file's quantized linear layers, two ways, on the CPU: the quantized kernel on the file's blocks
(kernels/native/quant_linear.py, what the worker runs for the GGUF types it takes, in float32) against
oneDNN on the dequantized float32 weights (kernels/cpu_linear.py, what it runs for the converted
directory). Every decoder layer's own weights, so they stream from memory as in a step, and the LM head;
checks both give the same products first. Prints the CPU beside the times.

    python -m tandem.benchmarks.quant_linear --model M.gguf [--rows 1,2,4,8,16,64,256,1024 --reps 7 --threads
    N]
        [--int8]   (also the kernel with int8 activations, --cpu-int8-activations, against the float32 one)

With --types instead of --model: the kernel on random blocks of each type, `--layers` weights of one
shape per type (distinct weights, so a pass streams them), timed round-robin (so load on a shared
machine falls on every type alike) and reported against the first type:

    python -m tandem.benchmarks.quant_linear --types Q4_1,Q4_0,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K [--shape
    4096x4096
        --layers 4 --rows 1 --reps 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tandem.benchmarks.linear_shape import median_ms
from tandem.kernels.cpu_linear import pack_weight, packed_linear
from tandem.kernels.native.cpu_caps import cpu_caps, usable_cores
from tandem.kernels.native.quant_linear import GGUF_BLOCKS, available, dequantize, pack, quant_linear
from tandem.protocol.gguf_metadata import open_gguf

# Byte offsets of each type's float16 scales in its GGUF block: set to small finite values in random blocks
# (any other bytes make a valid block).
_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    _, elems, size = GGUF_BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)
    for at in _SCALES[qtype]:
        raw[..., at : at + 2] = (
            rng.uniform(1e-4, 1e-3, (rows, cols // elems, 1)).astype(np.float16).view(np.uint8)
        )
    return raw.reshape(rows, -1)


def by_type(types: list[str], shape: str, layers: int, rows: list[int], reps: int,
            threads: int) -> dict[int, dict[str, float]]:
    """ms per pass over `layers` weights of each type, median over reps rounds (one call of each type a
    round).
    On one thread, the thread's CPU time: what other processes on a shared machine take is not counted."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    n, k = (int(v) for v in shape.split("x"))
    rng = np.random.default_rng(0)
    weights = {t: [pack(random_blocks(t, n, k, rng), t, k) for _ in range(layers)] for t in types}
    print(
        f"{layers} weights [{n}, {k}] a type; ms a pass ({'CPU' if threads == 1 else 'wall'} time), median of "
        f"{reps} rounds; ratio to {types[0]}"
    )
    results = {}
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {t: [] for t in types}
        for _ in range(reps + 1):  # the first round warms up
            for t in types:
                t0 = clock()
                for w in weights[t]:
                    quant_linear(x, w)
                times[t].append(clock() - t0)
        ms = {t: statistics.median(v[1:]) * 1e3 for t, v in times.items()}
        results[m] = ms
        for t in types:
            bits = weights[t][0].nbytes * 8 / (weights[t][0].data.shape[0] * 16 * k)
            gbs = sum(w.nbytes for w in weights[t]) / ms[t] / 1e6
            print(f"rows {m:4d} {t}: {ms[t]:7.2f} ms  {ms[t] / ms[types[0]]:5.2f}x  ({bits:.3f} bits/weight, "
                  f"{gbs:5.1f} GB/s of blocks)", flush=True)
    return results


def main(
    argv: list[str] | None = None,
) -> dict[int, tuple[float, float, float, float]] | dict[int, dict[str, float]]:
    ap = argparse.ArgumentParser(prog="python -m tandem.benchmarks.quant_linear")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a .gguf file")
    src.add_argument(
        "--types", help="GGUF types, comma-separated: random blocks of each (the first is the base)"
    )
    ap.add_argument("--shape", default="4096x4096", help="with --types: out x in")
    ap.add_argument("--layers", type=int, default=4, help="with --types: weights a type")
    ap.add_argument("--rows", default=None, help="default 1,2,4,8,16,64,256,1024 (with --types: 1)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--int8", action="store_true", help="with --model: also the int8-activation kernel")
    args = ap.parse_args(argv)
    if not available():
        raise SystemExit("the quantized-linear kernel is not available here (no C compiler?)")
    torch.set_num_threads(args.threads)
    print(cpu_caps().describe(), f"threads {args.threads}")
    if args.types:
        rows = [int(r) for r in (args.rows or "1").split(",")]
        return by_type(args.types.split(","), args.shape, args.layers, rows, args.reps, args.threads)
    layers, head = [], None
    for t in open_gguf(args.model).tensors:
        if len(t.shape) != 2 or t.tensor_type.name not in GGUF_BLOCKS:
            continue
        q = pack(np.asarray(t.data), t.tensor_type.name, int(t.shape[0]))
        pair = (q, pack_weight(dequantize(q)))
        if t.name == "token_embd.weight" or t.name == "output.weight":
            head = pair  # the LM head (tied: the embedding)
        else:
            layers.append(pair)
    qbytes = sum(q.nbytes for q, _ in layers)
    print(f"{len(layers)} quantized layer weights ({qbytes / 1e6:.1f} MB as blocks, "
          f"{sum(q.out_features * q.in_features for q, _ in layers) * 4 / 1e6:.1f} MB in float32)"
          + (f", LM head {head[0].out_features}x{head[0].in_features}" if head else "")
          + f"; ms, median of {args.reps}")
    results = {}
    g = torch.Generator().manual_seed(0)
    for m in (int(r) for r in (args.rows or "1,2,4,8,16,64,256,1024").split(",")):
        xs = {k: torch.randn(m, k, generator=g) for k in {q.in_features for q, _ in layers + [head] if q}}
        for q, p in layers[:4] + ([head] if head else []):
            torch.testing.assert_close(
                quant_linear(xs[q.in_features], q), packed_linear(xs[q.in_features], p), rtol=1e-4, atol=1e-4
            )
        a = median_ms(lambda xs=xs: [quant_linear(xs[q.in_features], q) for q, _ in layers], args.reps)
        b = median_ms(lambda xs=xs: [packed_linear(xs[q.in_features], p) for q, p in layers], args.reps)
        c = d = float("nan")
        if head:
            c = median_ms(lambda xs=xs: quant_linear(xs[head[0].in_features], head[0]), args.reps)
            d = median_ms(lambda xs=xs: packed_linear(xs[head[0].in_features], head[1]), args.reps)
        results[m] = (a, b, c, d)
        print(f"rows {m:5d}: layers quantized {a:8.1f} ms, oneDNN float32 {b:8.1f} ms ({b / a:.2f}x) | "
              f"head {c:7.1f} vs {d:7.1f} ({d / c:.2f}x)", flush=True)
        if args.int8:
            for q, _ in layers[:4] + ([head] if head else []):
                x = xs[q.in_features]
                want = quant_linear(x, q)
                assert (quant_linear(x, q, int8=True) - want).norm() <= 0.05 * want.norm()
            e = median_ms(
                lambda xs=xs: [quant_linear(xs[q.in_features], q, int8=True) for q, _ in layers], args.reps
            )
            f = float("nan")
            if head:
                f = median_ms(
                    lambda xs=xs: quant_linear(xs[head[0].in_features], head[0], int8=True), args.reps
                )
            results[m] = (a, b, c, d, e, f)
            print(f"             int8 activations: layers {e:8.1f} ms ({a / e:.2f}x the float32 kernel) | "
                  f"head {f:7.1f} ({c / f:.2f}x)", flush=True)
    return results


if __name__ == "__main__":
    main()

"""A GGUF file's quantized linear layers, two ways, on the CPU: the quantized kernel on the file's blocks
(kernels/cpu_quant_linear.py, what the worker runs for Q4_0/Q4_1/Q4_K/Q8_0 in float32) against oneDNN on the
dequantized float32 weights (worker/layers/cpu_linear.py, what it runs for the converted directory). Every
decoder layer's own weights, so they stream from memory as in a step, and the LM head; checks both give
the same products first. Prints the CPU beside the times.

    python -m benchmarks.quant_linear --model M.gguf [--rows 1,2,4,8,16,64,256,1024 --reps 7 --threads N]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.linear_shape import median_ms
from kernels.native.cpu_caps import cpu_caps, usable_cores
from kernels.native.quant_linear import GGUF_BLOCKS, available, dequantize, pack, quant_linear
from protocol.gguf_metadata import open_gguf
from worker.layers.cpu_linear import pack_weight, packed_linear


def main(argv: list[str] | None = None) -> dict[int, tuple[float, float, float, float]]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quant_linear")
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--rows", default="1,2,4,8,16,64,256,1024")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=usable_cores())
    args = ap.parse_args(argv)
    if not available():
        raise SystemExit("the quantized-linear kernel is not available here (no C compiler?)")
    torch.set_num_threads(args.threads)
    print(cpu_caps().describe(), f"threads {args.threads}")
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
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g) for k in {q.in_features for q, _ in layers + [head] if q}}
        for q, p in layers[:4] + ([head] if head else []):
            torch.testing.assert_close(quant_linear(xs[q.in_features], q), packed_linear(xs[q.in_features], p),
                                       rtol=1e-4, atol=1e-4)
        a = median_ms(lambda xs=xs: [quant_linear(xs[q.in_features], q) for q, _ in layers], args.reps)
        b = median_ms(lambda xs=xs: [packed_linear(xs[q.in_features], p) for q, p in layers], args.reps)
        c = d = float("nan")
        if head:
            c = median_ms(lambda xs=xs: quant_linear(xs[head[0].in_features], head[0]), args.reps)
            d = median_ms(lambda xs=xs: packed_linear(xs[head[0].in_features], head[1]), args.reps)
        results[m] = (a, b, c, d)
        print(f"rows {m:5d}: layers quantized {a:8.1f} ms, oneDNN float32 {b:8.1f} ms ({b / a:.2f}x) | "
              f"head {c:7.1f} vs {d:7.1f} ({d / c:.2f}x)", flush=True)
    return results


if __name__ == "__main__":
    main()

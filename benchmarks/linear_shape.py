"""One CPU product, x [rows, in] times weight [out, in], three ways: `F.linear(x, weight)` (the BLAS),
`weight @ x.T`, and oneDNN on the packed weight (`packed_linear`, what the worker runs in float32), over
every linear layer of a model shape (each layer's own weights, so they stream from memory as in a decode
step) and over its LM head. Prints the CPU beside the times.

    python -m tandem.benchmarks.linear_shape [--layers 30 --hidden 576 --intermediate 1536 --q-heads 9 \
        --kv-heads 3 --head-dim 64 --vocab 49152 --threads N]     (defaults: SmolLM2-135M)
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.kernels.cpu_linear import pack_weight, packed_linear
from tandem.kernels.native.cpu_caps import cpu_caps, usable_cores


def median_ms(f: Callable[[], object], reps: int) -> float:
    """Median wall time of `reps` calls of f, in ms, after one warm-up call."""
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t().contiguous()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tandem.benchmarks.linear_shape")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="1,2,5,16,32,48,64,128")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=usable_cores())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_caps().describe(), f"threads {args.threads}")
    h, d = args.hidden, args.head_dim
    shapes = [((args.q_heads + 2 * args.kv_heads) * d, h), (h, args.q_heads * d),
              (2 * args.intermediate, h), (h, args.intermediate)]
    layers = [[torch.randn(o, i) for o, i in shapes] for _ in range(args.layers)]
    packed = [[pack_weight(w) for w in ws] for ws in layers]
    head = torch.randn(args.vocab, h)
    head_packed = pack_weight(head)
    print(f"layers {args.layers} x {shapes}, head {tuple(head.shape)}, float32; ms, median of {args.reps}")
    print(
        f"{'rows':>5} | {'layers: linear':>14} {'w @ x.T':>8} {'packed':>7} {'gain':>6} | {'head: linear':>12} "
        f"{'w @ x.T':>8} {'packed':>7} {'gain':>6}"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {i: torch.randn(rows, i) for _, i in shapes}

            def stack(fn: Callable[..., torch.Tensor], ws: list = layers, xs: dict = xs) -> None:
                for lw, lp in zip(layers, ws, strict=True):
                    for w, p in zip(lw, lp, strict=True):
                        fn(xs[w.shape[1]], p)

            a = median_ms(lambda: stack(F.linear), args.reps)
            b = median_ms(lambda: stack(_transposed), args.reps)
            c = median_ms(lambda: stack(packed_linear, packed), args.reps)
            hx = torch.randn(rows, h)
            d = median_ms(lambda hx=hx: F.linear(hx, head), args.reps)
            e = median_ms(lambda hx=hx: _transposed(hx, head), args.reps)
            f = median_ms(lambda hx=hx: packed_linear(hx, head_packed), args.reps)
            print(
                f"{rows:>5} | {a:>14.1f} {b:>8.1f} {c:>7.1f} {a / c:>5.2f}x | {d:>12.2f} {e:>8.2f} {f:>7.2f} "
                f"{d / f:>5.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()

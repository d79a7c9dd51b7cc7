"""The two shapes of one CPU product, x [rows, in] times weight [out, in]: `F.linear(x, weight)` against
`cpu_linear` (weight @ x.T, one row padded to two), over every linear layer of a model shape (each layer's
own weights, so they stream from memory as in a decode step) and over its LM head. Prints the CPU beside
the times; the worker takes the transposed form up to `CPU_TRANSPOSED_MAX_ROWS` rows.

    python -m benchmarks.linear_shape [--layers 30 --hidden 576 --intermediate 1536 --q-heads 9 \
        --kv-heads 3 --head-dim 64 --vocab 49152 --threads N]     (defaults: SmolLM2-135M)
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker.cpu_caps import cpu_caps, usable_cores
from worker.layers.cpu_linear import CPU_TRANSPOSED_MAX_ROWS, cpu_linear


def _ms(f: Callable[[], object], reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cpu_linear(x, w, max_rows=1 << 30)  # the transposed form at any row count


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.linear_shape")
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
              (2 * args.intermediate, h), (h, args.intermediate)]  # fmt: skip
    layers = [[torch.randn(o, i) for o, i in shapes] for _ in range(args.layers)]
    head = torch.randn(args.vocab, h)
    print(f"layers {args.layers} x {shapes}, head {tuple(head.shape)}, float32")
    print(f"{'rows':>5} {'layers linear':>14} {'cpu_linear':>11} {'ratio':>6}   {'head linear':>12} "
          f"{'cpu_linear':>11} {'ratio':>6}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {i: torch.randn(rows, i) for _, i in shapes}

            def stack(fn: Callable[..., torch.Tensor], xs: dict = xs) -> None:
                for ws in layers:
                    for w in ws:
                        fn(xs[w.shape[1]], w)

            a = _ms(lambda: stack(F.linear), args.reps)
            b = _ms(lambda: stack(_transposed), args.reps)
            hx = torch.randn(rows, h)
            c = _ms(lambda hx=hx: F.linear(hx, head), args.reps)
            e = _ms(lambda hx=hx: _transposed(hx, head), args.reps)
            mark = "" if rows <= CPU_TRANSPOSED_MAX_ROWS else " (worker: F.linear)"
            print(f"{rows:>5} {a:>12.1f}ms {b:>9.1f}ms {a / b:>5.2f}x{mark:<19} {c:>10.2f}ms {e:>9.2f}ms "
                  f"{c / e:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()

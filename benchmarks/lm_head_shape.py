"""The CPU LM head's two shapes of one product, h [rows, hidden] x weight [vocab, hidden]:
`F.linear(h, weight)` against `weight @ h.T`, at SmolLM2's size by default. Prints the CPU beside the
times; the worker takes the transposed form up to `CPU_HEAD_TRANSPOSED_MAX_ROWS` rows.

    python -m benchmarks.lm_head_shape [--vocab 49152 --hidden 576 --threads N]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker.cpu_caps import cpu_caps, usable_cores


def _ms(f: Callable[[], torch.Tensor], reps: int = 10) -> float:
    for _ in range(3):
        f()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lm_head_shape")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--threads", type=int, default=usable_cores())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_caps().describe(), f"threads {args.threads}")
    w = torch.randn(args.vocab, args.hidden)
    print(f"{'rows':>5} {'linear ms':>10} {'w @ h.T ms':>11} {'ratio':>6}")
    with torch.inference_mode():
        for rows in (1, 2, 5, 16, 64, 256):
            h = torch.randn(rows, args.hidden)
            a = _ms(lambda h=h: F.linear(h, w))
            b = _ms(lambda h=h: torch.mm(w, h.t()).t())
            print(f"{rows:>5} {a:>10.2f} {b:>11.2f} {a / b:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()

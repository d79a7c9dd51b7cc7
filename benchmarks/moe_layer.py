"""One MoE layer on CPU (kernels/csrc/moe.c: router, top-k, the routed experts) against the dense SwiGLU MLP
of
the same active size through oneDNN, as the engine runs each in float32, at several row counts.

    python -m tandem.benchmarks.moe_layer [--hidden 512 --moe-intermediate 768 --experts 8 --top-k 2]
                                   [--rows 1,16,64,512] [--threads 1] [--reps 40]

The two alternate call by call and the fastest of each is kept (other processes' bursts only slow a call).
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.kernels.cpu_linear import pack_weight, packed_linear
from tandem.kernels.native import moe, norm_act


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tandem.benchmarks.moe_layer", description=__doc__.split("\n")[0]
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rows", default="1,16,64,512")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=40)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    h, i, e, k = a.hidden, a.moe_intermediate, a.experts, a.top_k
    w13 = moe.pack_experts(torch.randn(e, 2 * i, h, generator=g) / h**0.5)
    w2 = moe.pack_experts(torch.randn(e, h, i, generator=g) / i**0.5)
    router = moe.pack_router(torch.randn(e, h, generator=g) * 3 / h**0.5)
    gate_up = pack_weight(torch.randn(2 * k * i, h, generator=g) / h**0.5)
    down = pack_weight(torch.randn(h, k * i, generator=g) / (k * i) ** 0.5)
    print(f"hidden {h}, {e} experts x {i}, top {k} (dense MLP {k * i}), {a.threads} thread(s), float32")
    for rows in (int(r) for r in a.rows.split(",")):
        x = torch.randn(rows, h, generator=g)
        best = {"moe": float("inf"), "dense": float("inf")}
        for _ in range(a.reps):
            t = time.perf_counter()
            moe.moe(x, w13, w2, k, True, router=router)
            best["moe"] = min(best["moe"], time.perf_counter() - t)
            t = time.perf_counter()
            packed_linear(norm_act.silu_mul(packed_linear(x, gate_up)), down)
            best["dense"] = min(best["dense"], time.perf_counter() - t)
        print(
            f"rows {rows:5d}: MoE layer {best['moe'] * 1e3:8.3f} ms, dense MLP {best['dense'] * 1e3:8.3f} ms, "
            f"MoE / dense {best['moe'] / best['dense']:.2f}"
        )


if __name__ == "__main__":
    main()

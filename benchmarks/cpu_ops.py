"""A decoder layer's elementwise steps on the CPU, C kernel against its torch reference, per call: the
residual add with RMSNorm (kernels/native/norm_act.py), SiLU-times-up (the same) and the rotary embedding of
q and k (kernels/native/rotary.py), at a decode step's few rows and a prefill's many, for a model's shapes.
The two run alternately, best of `--reps` rounds of `--calls` calls each, so a noisy neighbour hits both
alike. Prints the CPU beside the times.

    python -m tandem.benchmarks.cpu_ops [--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim
    64]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tandem.kernels.native import norm_act as cpu_norm_act
from tandem.kernels.native import rotary as cpu_rotary
from tandem.kernels.native.cpu_caps import cpu_caps
from tandem.kernels.reference import norm_act as ref_norm_act
from tandem.kernels.reference.rotary import apply_rotary_ref
from tandem.worker.layers.rotary import RotaryEmbedding


def best_us(fs: dict[str, Callable[[], object]], reps: int, calls: int) -> dict[str, float]:
    best = {name: float("inf") for name in fs}
    for _ in range(reps):
        for name, f in fs.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def _ops(
    m: int, args: argparse.Namespace, rot: RotaryEmbedding, w: torch.Tensor, g: torch.Generator
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Each op at m rows: (C kernel, torch reference)."""
    h, d = torch.randn(m, args.hidden, generator=g), torch.randn(m, args.hidden, generator=g)
    gu = torch.randn(m, 2 * args.intermediate, generator=g)
    qkv = torch.randn(m, (args.heads + 2 * args.kv_heads) * args.head_dim, generator=g)
    # as the model rotates
    qk = qkv[:, : (args.heads + args.kv_heads) * args.head_dim].view(m, -1, args.head_dim)
    cos, sin = rot.cos_sin(torch.randint(0, 4096, (m,), generator=g), 4096)
    return {
        "add+rmsnorm": (lambda: cpu_norm_act.add_rms_norm(h, d, w, 1e-5),
                        lambda: ref_norm_act.add_rms_norm(h, d, w, 1e-5)),
        "silu*up": (lambda: cpu_norm_act.silu_mul(gu), lambda: ref_norm_act.silu_mul_ref(gu.clone())),
        "rotary q,k": (lambda: cpu_rotary.rotary(qk, cos, sin), lambda: apply_rotary_ref(qk, cos, sin)),
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(prog="python -m tandem.benchmarks.cpu_ops", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rows", default="1,16,512")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    if not (cpu_norm_act.available() and cpu_rotary.available()):
        raise SystemExit("the C kernels are not available here (no C compiler?)")
    print(cpu_caps().describe(), f"threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    rot = RotaryEmbedding(args.head_dim, 10000.0, {}, torch.float32, "cpu")
    w = torch.randn(args.hidden, generator=g)
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            for name, (c, ref) in _ops(m, args, rot, w, g).items():
                t = best_us({"c": c, "torch": ref}, args.reps, args.calls)
                out[f"{name} rows {m}"] = t
                print(f"rows {m:5d} {name:12s}: C {t['c']:8.1f} us, torch {t['torch']:8.1f} us "
                      f"({t['torch'] / t['c']:.2f}x)", flush=True)
    return out


if __name__ == "__main__":
    main()

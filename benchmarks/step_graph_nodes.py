"""Where a batch-1 decode step's time goes on CPU: the whole step, its replay (the recorded step graph), and
the replay's nodes by kind: each kind alone, and what it costs in the step (the replay less the replay
without it, run back to back: there its data has been pushed out of the caches by the rest).

One request decodes in-process (the real Scheduler and ModelRunner, no processes) until its KV holds
`--context` tokens; its steps are timed whole and their replays apart. Then the graph's buffers keep that
request's last inputs, and subsets of the recorded nodes are replayed over them, each the median of
`--reps` runs. A kind's nodes replayed alone keep their order; nothing is checked, only timed.

    python -m tandem.benchmarks.step_graph_nodes --model model.gguf [--cpu-int8-activations] \
        [--kv-cache-dtype float16] [--context 128] [--reps 200]
"""
from __future__ import annotations

# Before torch allocates anything: the worker process does the same at start (see worker/malloc_tuning).
from tandem.worker.malloc_tuning import keep_freed_memory

keep_freed_memory()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from tandem.benchmarks.worker_step import run_workload  # noqa: E402
from tandem.kernels.native import step_graph as sg  # noqa: E402
from tandem.kernels.native.cpu_caps import cpu_caps  # noqa: E402
from tandem.protocol.engine_config import EngineConfig  # noqa: E402
from tandem.protocol.model_info import read_model_info  # noqa: E402
from tandem.scheduler.scheduler import Scheduler  # noqa: E402
from tandem.worker.cpu_step_graph import CpuStepGraph  # noqa: E402
from tandem.worker.model_runner import ModelRunner  # noqa: E402

KINDS = {
    sg.EMBED: "embed",
    sg.NORM: "norm",
    sg.HEAD_NORM: "head_norm",
    sg.QLINEAR: "linear",
    sg.ROTARY: "rotary",
    sg.KV_WRITE: "kv_write",
    sg.ATTENTION: "attention",
    sg.SILU_MUL: "silu_mul",
    sg.MOE: "moe",
    sg.GELU_MUL: "gelu_mul",
    sg.ARGMAX: "argmax",
}


def _once(nodes: torch.Tensor, threads: int) -> float:
    t0 = time.perf_counter()
    sg.run(nodes, 1, threads)
    return time.perf_counter() - t0


def median_ms(nodes: torch.Tensor, threads: int, reps: int) -> float:
    nodes = nodes.contiguous()
    _once(nodes, threads)  # warm-up
    return 1000 * statistics.median(_once(nodes, threads) for _ in range(reps))


def paired_ms(full: torch.Tensor, part: torch.Tensor, threads: int, reps: int) -> float:
    """Median over reps of (full replay - replay of part), the two run back to back: this VM's speed drifts
    by more than a small kind costs, between two medians taken one after the other."""
    part = part.contiguous()
    _once(part, threads)
    return 1000 * statistics.median(_once(full, threads) - _once(part, threads) for _ in range(reps))


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", required=True)
    ap.add_argument(
        "--context", type=int, default=128, help="tokens in the request's KV when the nodes are timed"
    )
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--cpu-int8-activations", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.context < 2 or args.reps < 1:
        ap.error("--context must be at least 2 and --reps at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(cpu_caps().describe())
    cfg = EngineConfig(model=args.model, kv_cache_tokens=max(4096, 2 * args.context), max_running_requests=8,
                       dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                       cpu_int8_activations=args.cpu_int8_activations)
    info = read_model_info(args.model, cfg.max_model_len)
    runner = ModelRunner(cfg, info)
    graph = runner.graphs
    if not isinstance(graph, CpuStepGraph):
        raise SystemExit(f"{args.model}: no CPU step graph here (--enforce-eager, a GPU, or no C kernels)")
    sched = Scheduler(cfg, info, runner.num_kv_slots, num_swa_slots=runner.num_swa_slots)
    prompt = [(7 + 13 * i) % 500 + 3 for i in range(args.context // 2)]
    replays: list[float] = []
    run = sg.run

    def timed(nodes: torch.Tensor, rows: int, n: int) -> None:
        t0 = time.perf_counter()
        run(nodes, rows, n)
        replays.append(time.perf_counter() - t0)

    sg.run = timed  # the graph calls it through the module
    try:
        steps = run_workload(runner, sched, [prompt], args.context - len(prompt) + 1, "nodes")
    finally:
        sg.run = run
    decode = [dt for _, _, dt in steps[1:]]
    step_ms, replay_ms = 1000 * statistics.median(decode), 1000 * statistics.median(replays)
    print(f"model {args.model}: {len(graph.nodes)} nodes, {threads} threads, context {args.context}, "
          f"kv {runner.kv_dtype}, int8 activations {args.cpu_int8_activations}")
    print(f"decode step {step_ms:.3f} ms (median of {len(decode)}), its replay {replay_ms:.3f} ms: "
          f"{step_ms - replay_ms:.3f} ms outside the replay")
    kinds = graph.nodes[:, 0]
    full = median_ms(graph.nodes, threads, args.reps)
    print(f"replay of every node, on the last step's inputs: {full:.3f} ms")
    result = {"step_ms": step_ms, "replay_ms": replay_ms, "all_nodes_ms": full}
    for k in sorted(set(kinds.tolist())):
        name = KINDS.get(k, str(k))
        alone = median_ms(graph.nodes[kinds == k], threads, args.reps)
        in_step = paired_ms(graph.nodes, graph.nodes[kinds != k], threads, args.reps)
        print(
            f"  {name:>10} x{int((kinds == k).sum()):<4} alone {alone:7.3f} ms   in the step {in_step:7.3f} ms"
        )
        result[f"{name}_alone_ms"], result[f"{name}_in_step_ms"] = alone, in_step
    return result


if __name__ == "__main__":
    main()

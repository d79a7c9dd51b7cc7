"""In-process worker step benchmark: the real Scheduler + ModelRunner, no processes or IPC.

Runs the offline workload (default: 64 requests, prompts 64-512 tokens, 128 greedy outputs each) step by
step and times every ModelRunner.execute, then a single request decoding alone. Reports total tok/s, the
prefill-step time and tok/s, the mean decode-step time at full batch and the batch-1 decode ms/token.
`--attention-backend torch,cpu` runs the workload once per backend in the same process (in
turn, so a noisy neighbour hits both alike) and prints each.

    python -m tandem.benchmarks.worker_step --model models/bench-llama [--profile] [--attention-backend A,B]
"""
from __future__ import annotations

# Before torch allocates anything: the worker process does the same at start (see worker/malloc_tuning).
from tandem.worker.malloc_tuning import keep_freed_memory

keep_freed_memory()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from tandem.benchmarks.workload import parse_range, random_prompts  # noqa: E402
from tandem.kernels.native.cpu_caps import cpu_caps  # noqa: E402
from tandem.kernels.ops import resolve_ops  # noqa: E402
from tandem.protocol.engine_config import EngineConfig  # noqa: E402
from tandem.protocol.messages import TokenizedRequest  # noqa: E402
from tandem.protocol.model_info import read_model_info  # noqa: E402
from tandem.protocol.sampling_params import SamplingParams  # noqa: E402
from tandem.scheduler.scheduler import Scheduler  # noqa: E402
from tandem.worker.attention_backend import select_attention_backend  # noqa: E402
from tandem.worker.model_runner import ModelRunner  # noqa: E402


def run_workload(
    runner: ModelRunner, sched: Scheduler, prompts: list[list[int]], max_tokens: int, tag: str
) -> list[tuple[int, int, float]]:
    """Runs prompts to completion; returns (tokens, batch size, seconds) per step. One Scheduler serves all
    runs: it frees the previous run's worker rows in its next step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        sched.add_request(TokenizedRequest(f"{tag}{i}", ids, params))
    steps = []
    while sched.has_work:
        so = sched.schedule()
        if so is None:
            break
        t0 = time.perf_counter()
        out = runner.execute(so)
        dt = time.perf_counter() - t0
        sched.commit(out)
        sched.take_outbox()
        ntok = sum(s.num_tokens for s in so.scheduled)
        steps.append((ntok, len(so.scheduled), dt))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/bench-llama")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", default="64:512")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch1-tokens", type=int, default=64, help="decode steps timed for batch 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--profile", action="store_true", help="torch.profiler table of one decode and one prefill step"
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto", help="comma-separated: each is run in turn")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    # No prefix cache: each backend runs the same prompts, and none may reuse the KV of an earlier run.
    cfg = EngineConfig(model=args.model, kv_cache_tokens=65536, max_running_requests=256, dtype=args.dtype,
                       prefix_cache=False)
    info = read_model_info(cfg.model)
    runner = ModelRunner(cfg, info)
    print(cpu_caps().describe())
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, model {args.model}, dtype {runner.dtype}"
    )
    sched = Scheduler(cfg, info, runner.num_kv_slots, num_swa_slots=runner.num_swa_slots)
    for name in args.attention_backend.split(","):
        runner.model.attn_backend = select_attention_backend(resolve_ops(runner.device, runner.dtype, name))
        print(f"--- attention backend {runner.model.attn_backend.name}")
        _run(runner, sched, args, name)


def _run(runner: ModelRunner, sched: Scheduler, args: argparse.Namespace, tag: str) -> None:
    prompts = random_prompts(args.model, args.num_requests, parse_range(args.input_len), args.seed)
    # Separate random prompts for warm-up and batch 1, so the prefix cache finds nothing to reuse.
    extra = random_prompts(args.model, 5, (256, 256), args.seed + 1)

    # Warm-up: a short run so first-call costs (allocator growth, rotary tables, thread pools) are paid.
    run_workload(runner, sched, extra[:4], 4, f"{tag}-warm")

    if args.profile:
        _profile(runner, sched, prompts, tag)
        return

    t0 = time.perf_counter()
    steps = run_workload(runner, sched, prompts, args.output_len, f"{tag}-r")
    wall = time.perf_counter() - t0
    n = args.num_requests
    total_out = n * args.output_len
    total_in = sum(len(p) for p in prompts)
    prefill = [(t, dt) for t, b, dt in steps if t > b]  # any step with a multi-token request
    decode_full = [dt for t, b, dt in steps if t == b and b == n]
    busy = sum(dt for _, _, dt in steps)

    # Batch 1: one request (prompt 256) decoding alone.
    b1 = run_workload(runner, sched, [extra[4]], args.batch1_tokens + 1, f"{tag}-b1")
    b1_dec = [dt for t, b, dt in b1 if t == 1]

    print(f"workload: {n} requests, prompts {args.input_len} ({total_in} tokens), {args.output_len} out each")
    print(f"total: {wall:.2f} s wall ({busy:.2f} s in execute), {(total_in + total_out) / wall:.0f} tok/s "
          f"(in+out), {total_out / wall:.0f} out tok/s, {len(steps)} steps")
    if prefill:
        pt = sum(t for t, _ in prefill)
        ps = sum(dt for _, dt in prefill)
        print(f"prefill steps: {len(prefill)}, mean {1000 * ps / len(prefill):.0f} ms "
              f"(median {1000 * statistics.median(dt for _, dt in prefill):.0f} ms), {pt / ps:.0f} tok/s")
    if decode_full:
        print(
            f"decode steps at batch {n}: {len(decode_full)}, mean {1000 * statistics.mean(decode_full):.1f} ms, "
            f"median {1000 * statistics.median(decode_full):.1f} ms, min {1000 * min(decode_full):.1f} ms"
        )
    if b1_dec:
        print(f"batch-1 decode: mean {1000 * statistics.mean(b1_dec):.2f} ms/token, "
              f"median {1000 * statistics.median(b1_dec):.2f}, min {1000 * min(b1_dec):.2f}")


def _profile(runner: ModelRunner, sched: Scheduler, prompts: list[list[int]], tag: str) -> None:
    """Profiles the execute of one full prefill step and a few full-batch decode steps."""
    from torch.profiler import ProfilerActivity, profile

    # Long enough that every request is still running once the last prompt's prefill is done.
    prefill_steps = sum(len(p) for p in prompts) // sched.cfg.max_num_batched_tokens + 1
    params = SamplingParams(max_tokens=prefill_steps + 8, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        sched.add_request(TokenizedRequest(f"{tag}-p{i}", ids, params))
    seen_prefill = decodes = 0
    while sched.has_work:
        so = sched.schedule()
        if so is None:
            break
        ntok = sum(s.num_tokens for s in so.scheduled)
        is_prefill = ntok > len(so.scheduled)
        want = (is_prefill and not seen_prefill) or (not is_prefill and len(so.scheduled) == len(prompts))
        if want and (is_prefill or decodes < 3):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = runner.execute(so)
            kind = "prefill" if is_prefill else "decode"
            print(f"=== {kind} step, {ntok} tokens, batch {len(so.scheduled)}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
            seen_prefill |= is_prefill
            decodes += not is_prefill
        else:
            out = runner.execute(so)
        sched.commit(out)
        sched.take_outbox()


if __name__ == "__main__":
    main()

"""The files one decode step passes through: the engine's Python files whose code runs in one batch-1 decode
step (the scheduler's schedule and commit, the worker's execute), traced with `sys.setprofile`, and the C
sources of the kernels its recorded step graph calls (each node's kernel library, its #includes).

A measure of how many concepts one step touches (docs/architecture.md); tests/test_layout.py holds it to a
budget.

    python -m tandem.benchmarks.decode_step_files [--model PATH] [--dtype auto]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tandem.kernels.native import step_graph
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import TokenizedRequest
from tandem.protocol.model_info import read_model_info
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tandem.worker.cpu_step_graph import CpuStepGraph
from tandem.worker.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ("frontend", "scheduler", "worker", "detokenizer", "protocol", "kernels", "launch", "tandem")


def _engine_file(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts[0] in ENGINE and rel.suffix == ".py" else None


def _c_closure(sources: set[Path]) -> set[str]:
    """The sources and every header they #include (quoted includes: the repository's own)."""
    seen: set[Path] = set()
    todo = list(sources)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in re.findall(r'#include\s+"([^"]+)"', path.read_text()):
            todo.append(path.parent / name)
    return {str(p.relative_to(ROOT)) for p in seen}


def decode_step_files(model: str, dtype: str = "auto") -> tuple[list[str], list[str]]:
    """(Python files, C files) of one batch-1 decode step, after a prefill and a few decode steps (so the
    step graph is recorded and every first-call path is behind us)."""
    cfg = EngineConfig(model=model, kv_cache_tokens=2048, max_running_requests=4, dtype=dtype)
    info = read_model_info(cfg.model)
    runner = ModelRunner(cfg, info)
    sched = Scheduler(cfg, info, runner.num_kv_slots, num_swa_slots=runner.num_swa_slots)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sched.add_request(TokenizedRequest("r", list(range(3, 40)), params))

    def step() -> None:
        so = sched.schedule()
        assert so is not None
        sched.commit(runner.execute(so))
        sched.take_outbox()

    for _ in range(6):
        step()
    seen: set[str] = set()

    def profile(frame, event, arg) -> None:
        if event == "call":
            name = _engine_file(frame.f_code.co_filename)
            if name:
                seen.add(name)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    c_files: list[str] = []
    if isinstance(runner.graphs, CpuStepGraph):
        kinds = set(runner.graphs.nodes[:, 0].tolist())
        sources = {step_graph.SOURCE}
        for kind in kinds:
            for arg in step_graph.ARGS[kind]:
                if arg.startswith("@"):
                    sources.add(step_graph.ENTRIES[arg[1:]][0].SOURCE)
        c_files = sorted(_c_closure(sources))
    return sorted(seen), c_files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    py, c = decode_step_files(args.model, args.dtype)
    print(f"{len(py)} Python files, {len(c)} C files")
    for name in py + c:
        print(f"  {name}")


if __name__ == "__main__":
    main()

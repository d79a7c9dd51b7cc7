"""Speculative decoding with the real worker in-process (the scheduler and the pipeline driver of the
fake-worker suite, a tiny model on CPU): a row whose n-gram matched nothing verifies no draft and runs
as a plain decode beside rows that verify theirs, and greedy outputs equal speculation off, token for
token, synchronous and with a step in flight."""
from __future__ import annotations

from pathlib import Path

import pytest

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import ModelRunnerOutput, SchedulerOutput, TokenizedRequest
from tandem.protocol.model_info import read_model_info
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tandem.worker.model_runner import ModelRunner
from tests.test_scheduler_core import run

K = 4


class Recorder:
    """The runner, with every step and its result kept."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.steps: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.runner.execute(so)
        self.steps.append((so, out))
        return out


def _generate(
    model: Path, prompts: list[list[int]], depth: int, spec: bool
) -> tuple[dict, Recorder, Scheduler]:
    cfg = EngineConfig(model=str(model), kv_cache_tokens=2048, max_running_requests=8, device="cpu",
                       dtype="float32", async_scheduling=depth == 2, debug_integrity=True,
                       speculative_method="ngram" if spec else None, num_speculative_tokens=K)
    info = read_model_info(cfg.model)
    runner = ModelRunner(cfg, info)
    sched = Scheduler(cfg, info, runner.num_kv_slots, num_swa_slots=runner.num_swa_slots)
    rec = Recorder(runner)
    for i, p in enumerate(prompts):
        sched.add_request(
            TokenizedRequest(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        )
    outputs, _ = run(sched, rec, depth)
    return outputs, rec, sched


@pytest.mark.parametrize("depth", [1, 2])
def test_unmatched_rows_run_plain_beside_verified_ones(tiny_model, depth: int) -> None:
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8, 9, 10] * 5, list(range(100, 130)), [40, 41] * 8, list(range(300, 311))]
    want, _, _ = _generate(model, prompts, depth, spec=False)
    got, rec, sched = _generate(model, prompts, depth, spec=True)
    assert got == want
    mixed = 0
    for so, out in rec.steps:
        samplers = [s for s in so.scheduled if s.sample]
        if not any(s.num_drafts for s in samplers):
            assert out.num_drafts is None
            continue
        assert out.num_drafts is not None and len(out.num_drafts) == len(samplers)
        assert all(v <= s.num_drafts for v, s in zip(out.num_drafts, samplers, strict=True))
        # Each row emits 1 + its accepted drafts, never more than it verified.
        counts = out.num_sampled or [1] * len(samplers)  # None: every draft skipped, one token each
        assert all(1 <= n <= v + 1 for n, v in zip(counts, out.num_drafts, strict=True))
        verified = [v for v, s in zip(out.num_drafts, samplers, strict=True) if s.num_drafts]
        mixed += 0 in verified and any(verified)
    assert mixed, "no step had a matched and an unmatched row side by side"
    assert 0 < sched.spec.accepted_tokens <= sched.spec.draft_tokens
    # Only verified drafts are counted: fewer than were scheduled.
    scheduled = sum(s.num_drafts for so, _ in rec.steps for s in so.scheduled)
    assert sched.spec.draft_tokens < scheduled

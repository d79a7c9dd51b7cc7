"""A launched step whose sampled tokens may still be on their way to the host.

On CUDA the forward and sampling are only queued when `launch` returns: the sampled ids come back
through a non-blocking copy into pinned memory and an event, so the worker can queue the next step's
forward before waiting for them (the next step reads the real tokens on the device). Device time is
measured with events: busy = the step's own span, idle = the gap after the previous step (the bubble).
On CPU everything already happened; busy/idle are wall-clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tandem.protocol.messages import Logprobs, ModelRunnerOutput


@dataclass
class PendingStep:
    step_id: int
    tokens: torch.Tensor | None  # sampled ids: a host tensor (maybe still being copied) or None
    num_sampled: list[int] | None = None  # tokens per sampling request when some had drafts
    num_drafts: list[int] | None = None  # drafts each sampling request verified (CPU: only matched ones)
    logprobs: list[Logprobs | None] | None = None
    prompt_logprobs: dict[int, Logprobs] | None = None
    embeddings: dict[int, torch.Tensor] | None = None  # pooled vectors by row (float32, on the device)
    busy_s: float = 0.0  # CPU path: measured at launch
    images_encoded: int = 0
    images_kept: list[str] | None = None
    idle_s: float = 0.0
    done: torch.cuda.Event | None = None  # CUDA path: set when the copy to the host is complete
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    prev_end: torch.cuda.Event | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def result(self) -> ModelRunnerOutput:
        if self.done is not None:
            self.done.synchronize()
            assert self.start is not None and self.end is not None
            self.busy_s = self.start.elapsed_time(self.end) / 1000
            if self.prev_end is not None:
                self.idle_s = max(0.0, self.prev_end.elapsed_time(self.start) / 1000)
        sampled = self.tokens.tolist() if self.tokens is not None else []
        vectors = (
            {r: v.cpu().numpy().astype("<f4").tobytes() for r, v in self.embeddings.items()}
            if self.embeddings
            else None
        )
        return ModelRunnerOutput(
            self.step_id, sampled, num_sampled=self.num_sampled, num_drafts=self.num_drafts,
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            busy_s=self.busy_s, idle_s=self.idle_s, embeddings=vectors, images_encoded=self.images_encoded,
            images_kept=self.images_kept,
        )


class StepClock:
    """Start/end marks for each step on the device timeline (CUDA) or the wall clock (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._last_end: torch.cuda.Event | None = None
        self._last_wall_end: float | None = None

    def begin(self) -> tuple[float, torch.cuda.Event | None]:
        if not self.cuda:
            return time.perf_counter(), None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return time.perf_counter(), ev

    def finish(self, step: PendingStep, t0: float, start: torch.cuda.Event | None, after_idle: bool) -> None:
        """after_idle: the engine had nothing to do before this step, so the gap is no bubble."""
        if after_idle:
            self._last_end, self._last_wall_end = None, None
        if not self.cuda:
            now = time.perf_counter()
            step.busy_s = now - t0
            step.idle_s = 0.0 if self._last_wall_end is None else max(0.0, t0 - self._last_wall_end)
            self._last_wall_end = now
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        done = torch.cuda.Event()
        done.record()
        step.start, step.end, step.done, step.prev_end = start, end, done, self._last_end
        self._last_end = end

"""Per-step timing: scheduler CPU time, worker busy time, and the worker's idle gap (the bubble)."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.protocol.heap_sample import HeapSample
from tandem.protocol.messages import ModelRunnerOutput


@dataclass
class StepStats:
    steps: int = 0
    schedule_s: float = 0.0
    worker_busy_s: float = 0.0
    worker_idle_s: float = 0.0
    images_encoded: int = 0  # by the worker's encoder (an image whose KV or encoding was kept is not)
    worker_heap: HeapSample | None = None  # rank 0's latest

    def on_schedule(self, dt: float) -> None:
        self.schedule_s += dt

    def on_result(self, out: ModelRunnerOutput) -> None:
        self.steps += 1
        self.worker_busy_s += out.busy_s
        self.worker_idle_s += out.idle_s
        self.images_encoded += out.images_encoded
        if out.heap is not None:
            self.worker_heap = out.heap

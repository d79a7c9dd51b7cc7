"""A step that raised on the worker. Its StepFailed goes back in step order, and the worker serves on:
the scheduler fails the requests to blame and recomputes the others.

The rows of a failed step are poisoned until the scheduler frees them (it retracts or fails every
request of the steps in flight), since their worker state is half-updated: a later step already sent
that schedules one of them is skipped rather than run on that state.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.protocol.errors import ErrorCode
from tandem.protocol.fault_injection import InjectedFault
from tandem.protocol.messages import StepFailed


class RequestFault(RuntimeError):
    """An exception attributable to some requests of a step: `rows` are theirs."""

    def __init__(self, rows: Sequence[int], code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.rows = list(rows)
        self.code = code


@dataclass
class FailedStep:
    """Stands in the worker's queue of launched steps like a PendingStep."""

    step_id: int
    req_pool_indices: list[int]
    code: str
    message: str
    ready: bool = True

    def result(self) -> StepFailed:
        return StepFailed(self.step_id, self.req_pool_indices, self.code, self.message)


def describe(step_id: int, e: Exception) -> FailedStep:
    if isinstance(e, RequestFault):
        return FailedStep(step_id, e.rows, e.code, str(e))
    import torch  # here, not above: the launcher imports the worker's process module, and never torch

    if isinstance(e, torch.OutOfMemoryError):
        return FailedStep(step_id, [], ErrorCode.OUT_OF_MEMORY, f"step ran out of memory: {e}")
    return FailedStep(step_id, [], ErrorCode.FAILED_INTERNAL, f"step failed: {type(e).__name__}: {e}")


def survivable(e: Exception, tp_size: int) -> bool:
    """With tensor parallelism the ranks must stay in lockstep: only a fault every rank raises alike (an
    injected one, before any collective) is survivable; anything else ends the engine."""
    return tp_size == 1 or isinstance(e.__cause__, InjectedFault)

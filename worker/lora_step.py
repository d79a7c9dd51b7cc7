"""A step's LoRA adapters: which token rows of the batch run under which device slot (layers/lora.py).

The rows of a request's tokens (its extend, drafts included) take its adapter's delta; a step whose rows all
run the base sets none, so its products are the base's alone (and the step may run as a recorded graph).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from tandem.kernels.reference.lora import LoraRows
from tandem.protocol.lora import LoraConfig, LoraModule, read_lora
from tandem.protocol.lora_messages import LoraSlotLoad
from tandem.protocol.messages import ScheduledReq
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.layers.lora import LoraContext, install_slots
from tandem.worker.lora_weights import Pairs, load_adapter, read_adapter
from tandem.worker.request_state import RequestState


class WorkerAdapters:
    """The worker's side of the adapters: slots in every layer an adapter may target, filled as the
    scheduler orders (SchedulerOutput.lora_loads), each adapter read from its file once per load and kept in
    host memory until the scheduler says it is unloaded (lora_forget)."""

    def __init__(self, model: torch.nn.Module, slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.max_rank = model, max_rank
        self.ctx = install_slots(model, slots, max_rank, dtype, device)
        self.host: dict[tuple[str, int], tuple[LoraConfig, Pairs]] = {}

    def set_step(self, sched: Sequence[ScheduledReq], state: RequestState, batch: ForwardBatch) -> None:
        """The step's adapters into every target layer's context."""
        self.ctx.groups = lora_groups(sched, state, batch)

    def apply(self, loads: Sequence[LoraSlotLoad], forget: Sequence[tuple[str, int]]) -> None:
        for key in forget:
            self.host.pop(tuple(key), None)  # type: ignore[arg-type]
        for order in loads:
            key = (order.name, order.generation)
            if key not in self.host:
                cfg = read_lora(LoraModule(order.name, order.path), self.max_rank)
                self.host[key] = (cfg, read_adapter(cfg, self.model.config))
            load_adapter(self.model, order.slot, *self.host[key])


@contextlib.contextmanager
def rows_from(ctx: LoraContext | None, slot_of_row: torch.Tensor) -> Iterator[None]:
    """The target layers run each row under the adapter of its slot in `slot_of_row` (a recorded graph's
    input buffer; -1: the base), then as they did before. ctx None: a model that takes no adapters."""
    if ctx is None:
        yield
        return
    before, ctx.groups = ctx.groups, LoraRows(slot_of_row)
    try:
        yield
    finally:
        ctx.groups = before


def lora_groups(sched: Sequence[ScheduledReq], state: RequestState, batch: ForwardBatch) -> LoraRows | None:
    """The step's token rows by adapter; None: the step runs the base alone."""
    if not state.lora_slot:
        return None
    slots = [state.lora_slot.get(s.req_pool_idx, -1) for s in sched]
    if max(slots) < 0:
        return None
    device = batch.input_ids.device
    per_row = [slot for slot, n in zip(slots, batch.extend_lens_cpu, strict=True) for _ in range(n)]  # type: ignore[arg-type]
    of_row = torch.tensor(per_row, dtype=torch.int64, device=device)
    if min(slots) == max(slots):
        return LoraRows(of_row, [(slots[0], None)])
    rows: dict[int, list[int]] = {}
    for t, slot in enumerate(per_row):
        if slot >= 0:
            rows.setdefault(slot, []).append(t)
    return LoraRows(of_row, [(s, torch.tensor(r, dtype=torch.int64, device=device)) for s, r in rows.items()])

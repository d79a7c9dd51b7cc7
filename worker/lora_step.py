"""A step's LoRA adapters: which token rows of the batch run under which device slot (layers/lora.py).

The rows of a request's tokens (its extend, drafts included) take its adapter's delta; a step whose rows all
run the base sets none, so its products are the base's alone (and the step may run as a recorded graph).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.protocol.lora import LoraModule, read_lora
from tandem.protocol.messages import ScheduledReq
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.layers.lora import LoraContext, install_slots
from tandem.worker.lora_weights import load_adapter
from tandem.worker.request_state import RequestState


def serve_adapters(model: torch.nn.Module, modules: list[str], slots: int, max_rank: int, dtype: torch.dtype,
                   device: torch.device) -> LoraContext:
    """Slots in every layer an adapter may target, the --lora-modules adapters in them in order."""
    ctx = install_slots(model, slots, max_rank, dtype, device)
    for slot, spec in enumerate(modules):
        load_adapter(model, slot, read_lora(LoraModule.parse(spec), max_rank))
    return ctx


def lora_groups(sched: Sequence[ScheduledReq], state: RequestState, batch: ForwardBatch,
                ) -> list[tuple[int, torch.Tensor | None]] | None:
    """(slot, token rows; None: all) of the step's adapters; None: the step runs the base alone."""
    if not state.lora_slot:
        return None
    slots = [state.lora_slot.get(s.req_pool_idx, -1) for s in sched]
    if max(slots) < 0:
        return None
    if min(slots) == max(slots):
        return [(slots[0], None)]
    rows: dict[int, list[int]] = {}
    for slot, start, n in zip(slots, batch.extend_starts_cpu, batch.extend_lens_cpu, strict=True):  # type: ignore[arg-type]
        if slot >= 0:
            rows.setdefault(slot, []).extend(range(start, start + n))
    device = batch.input_ids.device
    return [(slot, torch.tensor(r, dtype=torch.int64, device=device)) for slot, r in rows.items()]

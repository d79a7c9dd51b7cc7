"""Embeddings on the worker: which of a step's tokens have their final (normed) hidden states pooled, and
each embedding request's vector once its last prompt token is computed. A prompt may span several steps
(chunked prefill): the partial pool lives with the request's row until then, and a retraction, which
frees the row, starts it over."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.protocol.messages import ScheduledReq
from tandem.worker.request_state import RequestState


@dataclass
class PoolingPlan:
    hidden_indices: list[int]  # indices into the step's flattened tokens; their rows follow the logits rows
    rows: list[int]  # embedding rows with hidden states in this step, each with counts[i] consecutive ones
    counts: list[int]
    done: list[int]  # embedding rows whose prompt this step completes


def plan_pooling(sched: Sequence[ScheduledReq], state: RequestState, method: str) -> PoolingPlan | None:
    """mean pools every prompt token, cls the first, last the last. None: no embedding row in the step."""
    if not state.pool_params:
        return None
    plan = PoolingPlan([], [], [], [])
    total = 0
    for s in sched:
        r, n = s.req_pool_idx, s.num_tokens
        if r in state.pool_params:
            start = state.num_computed[r]
            end = start + n
            if method == "mean":
                idx = list(range(total, total + n))
            elif method == "cls":
                idx = [total] if start == 0 else []
            else:
                idx = [total + n - 1] if end == state.num_prompt[r] else []
            if idx:
                plan.hidden_indices += idx
                plan.rows.append(r)
                plan.counts.append(len(idx))
            if end == state.num_prompt[r]:
                plan.done.append(r)
        total += s.num_tokens
    return plan if plan.rows or plan.done else None


def pool_hidden(
    plan: PoolingPlan, hidden: torch.Tensor, state: RequestState, method: str
) -> dict[int, torch.Tensor]:
    """hidden [len(plan.hidden_indices), H]: added to each row's pool; the vectors (float32, on the device)
    of the rows that are done: averaged for mean, cut to `dimensions`, then L2-normalized if asked."""
    off = 0
    for r, c in zip(plan.rows, plan.counts):
        part = hidden[off : off + c].float().sum(0)
        off += c
        acc = state.pool_acc.get(r)
        state.pool_acc[r] = part if acc is None else acc.add_(part)
    out: dict[int, torch.Tensor] = {}
    for r in plan.done:
        v = state.pool_acc.pop(r)
        if method == "mean":
            v = v / state.num_prompt[r]
        p = state.pool_params[r]
        if p.dimensions is not None:
            v = v[: p.dimensions]  # a Matryoshka prefix: normalized after the cut, as it was trained
        out[r] = torch.nn.functional.normalize(v, dim=0) if p.normalize else v
    return out

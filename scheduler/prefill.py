"""Admitting waiting requests into the step, first come first served, under the token budget."""
from __future__ import annotations

from collections import deque

from protocol.messages import NewReqData, WorkerSampling
from scheduler.kv_cache import KVCacheManager
from scheduler.req import Req
from scheduler.step_plan import StepPlan


def admit_waiting(
    waiting: deque[Req], running: list[Req], kv: KVCacheManager, plan: StepPlan, max_running: int
) -> None:
    while waiting and plan.budget > 0 and len(running) < max_running:
        req = waiting[0]
        n = min(req.num_tokens_to_compute, plan.budget)
        # Leave one slot per running request so the admitted prefill doesn't force a retraction
        # at the very next decode.
        if kv.num_free_slots < n + len(running):
            break
        if not kv.assign_row(req):
            break
        slots = kv.grow(req, n)
        assert slots is not None  # checked above
        waiting.popleft()
        running.append(req)
        plan.new_reqs.append(new_req_data(req))
        req.needs_new_data = False
        plan.add(req, n, slots)


def new_req_data(req: Req) -> NewReqData:
    p = req.params
    assert req.req_pool_idx is not None
    return NewReqData(
        req_idx=req.req_pool_idx,
        token_ids=req.fill_ids,
        num_prompt=len(req.origin_input_ids),
        sampling=WorkerSampling(p.temperature, p.top_k, p.top_p, 0.0, p.seed),
    )

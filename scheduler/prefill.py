"""Admitting waiting requests into the step, first come first served, under the prefill budget.

A request is matched against the prefix cache first, so only its uncached suffix is computed;
a long prompt is split over steps (chunked prefill) by the same token accounting.
"""
from __future__ import annotations

from collections import deque

from protocol.messages import NewReqData, WorkerSampling
from scheduler.kv_cache import KVCacheManager
from scheduler.req import Req
from scheduler.step_plan import StepPlan


def admit_waiting(
    waiting: deque[Req], running: list[Req], kv: KVCacheManager, plan: StepPlan, max_running: int
) -> None:
    while waiting and plan.prefill_budget > 0 and len(running) < max_running:
        req = waiting[0]
        if not kv.assign_row(req):
            break
        # Prompt logprobs need every prompt position computed: no prefix-cache hit for such requests.
        kv.match_prefix(req, use_cache=req.params.prompt_logprobs is None)
        n = min(req.num_tokens_to_compute, plan.prefill_budget)
        # Keep a page per running request in reserve so the admitted prefill doesn't force a
        # retraction at the very next decode.
        reserve = len(running) * kv.page_size
        if kv.available_slots < kv.pages_needed(req, n) * kv.page_size + reserve:
            release_unadmitted(req, kv)
            break
        slots = kv.grow(req, n)
        if slots is None:
            release_unadmitted(req, kv)
            break
        waiting.popleft()
        running.append(req)
        plan.new_reqs.append(new_req_data(req))
        req.needs_new_data = False
        plan.add(req, n, slots, slot_start=0, prefix=req.prefix_indices)


def release_unadmitted(req: Req, kv: KVCacheManager) -> None:
    kv.unmatch_prefix(req)
    assert req.req_pool_idx is not None
    kv.req_table.free(req.req_pool_idx)
    req.req_pool_idx = None


def new_req_data(req: Req) -> NewReqData:
    p = req.params
    assert req.req_pool_idx is not None
    return NewReqData(
        req_idx=req.req_pool_idx,
        token_ids=req.fill_ids,
        num_prompt=len(req.origin_input_ids),
        num_cached=req.num_computed_tokens,
        sampling=WorkerSampling(
            p.temperature, p.top_k, p.top_p, p.min_p, p.seed,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            min_tokens=p.min_tokens,
            # A grammar decides where a constrained request may stop: min_tokens does not hold EOS back.
            suppress_ids=req.suppressed_ids if p.min_tokens and req.grammar is None else [],
            logprobs=-1 if p.logprobs is None else p.logprobs,
            prompt_logprobs=-1 if p.prompt_logprobs is None else p.prompt_logprobs,
        ),
    )

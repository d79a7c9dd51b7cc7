"""Scheduling the running requests: each catches up with its tokens (a decode is the case of one),
and retraction when the KV pool cannot give a running request its next tokens."""
from __future__ import annotations

from collections.abc import Callable

from tandem.scheduler.kv_cache import KVCacheManager
from tandem.scheduler.req import Req
from tandem.scheduler.scheduling_policy import SchedulingPolicy
from tandem.scheduler.spec_decode import Speculation
from tandem.scheduler.step_plan import StepPlan


def schedule_running(
    running: list[Req], policy: SchedulingPolicy, kv: KVCacheManager, plan: StepPlan,
    retract: Callable[[Req], None], spec: Speculation | None = None,
) -> None:
    """In the policy's order; it also picks whom to retract. spec: speculative decoding (None: off)."""
    for req in policy.running_order(running):
        if plan.budget <= 0:
            break
        if req.finished() or req.to_finish is not None or req.req_pool_idx is None:
            continue
        # Outputs already in flight reach max_tokens: scheduling more would only be dropped.
        if req.embed is None and req.num_outputs_optimistic >= req.max_new_tokens:
            continue
        todo = req.num_tokens_to_compute
        prefilling = req.is_prefilling  # draws on the prefill budget; a decode on the step's
        n = min(todo, plan.prefill_budget if prefilling else plan.budget)
        if prefilling:
            n = plan.fit_images(req, n)
        if n <= 0:
            continue
        drafts = 0 if prefilling or spec is None else min(spec.num_drafts(req), plan.budget - n)
        slots = kv.grow(req, n + drafts)
        if slots is None and drafts:
            drafts = 0  # short of KV: drafts are the first thing to go, before any retraction
            slots = kv.grow(req, n)
        n += drafts
        while slots is None:
            victim = policy.victim(running, exclude=req)
            if victim is None:
                return  # nothing left to retract: req waits for in-flight steps to free memory
            retract(victim)
            slots = kv.grow(req, n)
        plan.add(req, n, slots, drafts=drafts)


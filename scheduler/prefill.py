"""Admitting waiting requests into the step, in the scheduling policy's order, under the prefill budget.

A request is matched against the prefix cache first, so only its uncached suffix is computed (the part
found in the host tier is copied back, not computed); a long prompt is split over steps (chunked prefill)
by the same token accounting.

A load is not free: it costs the step ceil(L / HOST_LOAD_DIVISOR) budget tokens for L tokens copied, so a
step cannot load a huge prefix and prefill a full budget besides. The divisor is what a loaded token costs
next to a computed one, taken where copies are dearest: on a GPU a token's KV crosses PCIe (~25 GB/s) in
an estimated tenth to fiftieth of the time its prefill takes for 0.1B-8B models; on a CPU the copy within
RAM measured over 100x cheaper than the prefill (SmolLM2-135M and bench-llama, 1024-token prompts). The
first admission of a step always goes in (with at least one token to compute), so a load bigger than a
whole step still runs.
"""
from __future__ import annotations

from tandem.protocol.messages import NewReqData, WorkerSampling
from tandem.scheduler.kv_cache import KVCacheManager
from tandem.scheduler.req import Req
from tandem.scheduler.scheduling_policy import SchedulingPolicy
from tandem.scheduler.step_plan import StepPlan

HOST_LOAD_DIVISOR = 16  # host-tier tokens loaded per step-budget token (see the module docstring)


def admit_waiting(
    waiting: SchedulingPolicy, running: list[Req], kv: KVCacheManager, plan: StepPlan, max_running: int
) -> None:
    """In the policy's order, stopping at the first request that does not fit (none overtakes it), but for
    one whose next image is past the step's encoder budget: it waits for the next step, and those behind
    it that encode nothing now (text) go on, so many images do not hold text requests back."""
    for req in list(waiting):
        if plan.prefill_budget <= 0 or len(running) >= max_running:
            break
        if not kv.assign_row(req):
            break
        if req.lora is not None:  # its adapter's device slot (none to be had: it waits, others go on)
            slot = plan.lora.acquire(req, running) if plan.lora else None
            if slot is None:
                release_unadmitted(req, kv)
                continue
            req.lora_slot = slot
        prefix = kv.match_prefix(req, prefix_limit(req), req.held_prefix)
        load = -(-prefix.host_hit_length // HOST_LOAD_DIVISOR)
        room = plan.prefill_budget - load
        first = not plan.prefill_used and not plan.load_used
        if room < 1 and not first:  # the load does not fit beside this step's other prefills: next step
            release_unadmitted(req, kv)
            break
        n = plan.fit_images(req, min(req.num_tokens_to_compute, max(room, 1)))
        if n < 1:  # its next image does not fit the step's encoder budget
            release_unadmitted(req, kv)
            continue
        # Device slots for the host part of the match and the tokens to compute; plus a page per running
        # request in reserve so the admitted prefill doesn't force a retraction at the very next decode.
        need = prefix.host_hit_length + kv.pages_needed(req, n) * kv.page_size
        reserve = len(running) * kv.page_size
        if kv.available_slots < need + reserve or not kv.ensure_free(need):
            release_unadmitted(req, kv)
            break
        prefix = kv.load_host(req)  # neither can run short now: nothing can fail once a load is queued
        plan.add_load(load)
        slots = kv.grow(req, n)
        if slots is None:
            raise RuntimeError(f"{req.rid}: KV slots vanished during admission")
        waiting.remove(req)
        running.append(req)
        plan.new_reqs.append(new_req_data(req))
        req.needs_new_data = False
        plan.add(req, n, slots, slot_start=0, prefix=prefix.indices)


def prefix_limit(req: Req) -> int | None:
    """Prompt tokens the prefix cache may serve. Prompt logprobs from index s on need the logits at
    positions s-1.. computed, so the cache serves at most s-1 tokens (s = logprob_start_len); a pooling
    that reads every prompt token's hidden state, none."""
    if req.pools_whole_prompt:
        return 0
    p = req.params
    return None if p.prompt_logprobs is None else max(p.logprob_start_len - 1, 0)


def release_unadmitted(req: Req, kv: KVCacheManager) -> None:
    kv.unmatch_prefix(req)
    assert req.req_pool_idx is not None
    kv.req_table.free(req.req_pool_idx)
    req.req_pool_idx = None


def new_req_data(req: Req) -> NewReqData:
    p = req.params
    assert req.req_pool_idx is not None
    return NewReqData(
        req_pool_idx=req.req_pool_idx,
        token_ids=req.fill_ids,
        num_prompt=len(req.origin_input_ids),
        num_cached=req.num_computed_tokens,
        images=req.images,
        lora_slot=req.lora_slot,
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
            prompt_logprob_start=p.logprob_start_len,
        ),
        pool=req.embed,
    )

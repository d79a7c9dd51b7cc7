"""One step being formed, and the record of a step in flight until its result is committed."""
from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import NewReqData, ScheduledReq, SchedulerOutput
from scheduler.req import Req


@dataclass
class StepPlan:
    budget: int
    reqs: list[Req] = field(default_factory=list)
    items: list[ScheduledReq] = field(default_factory=list)
    new_reqs: list[NewReqData] = field(default_factory=list)

    def add(self, req: Req, n: int, slots: list[int]) -> None:
        """Schedule n tokens of req whose KV slots were just allocated."""
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        sample = req.num_computed_tokens == req.seq_len
        if sample:
            req.num_output_placeholders += 1
        req.num_inflight_steps += 1
        self.budget -= n
        self.reqs.append(req)
        self.items.append(ScheduledReq(req.req_pool_idx or 0, n, start, slots, sample))


@dataclass
class InflightStep:
    step_id: int
    reqs: list[Req]
    epochs: list[int]  # each req's retraction epoch at scheduling time: stale results are dropped
    num_tokens: list[int]
    samplers: list[int]  # indices into reqs of those that sample, in result order


def to_output(step_id: int, freed_rows: list[int], plan: StepPlan) -> tuple[SchedulerOutput, InflightStep]:
    out = SchedulerOutput(step_id, freed_rows, plan.new_reqs, plan.items)
    record = InflightStep(
        step_id,
        plan.reqs,
        [r.epoch for r in plan.reqs],
        [it.num_tokens for it in plan.items],
        [i for i, it in enumerate(plan.items) if it.sample],
    )
    return out, record

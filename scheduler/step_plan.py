"""One step being formed, and the record of a step in flight until its result is committed."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.protocol.image_item import ImageItem
from tandem.protocol.messages import EncodeWork, NewReqData, ScheduledReq, SchedulerOutput
from tandem.scheduler.lora_adapters import LoraAdapters
from tandem.scheduler.req import Req


@dataclass
class StepPlan:
    budget: int  # tokens this step, all requests together
    prefill_cap: int  # of which at most this many for prefill chunks (--chunked-prefill-tokens)
    reqs: list[Req] = field(default_factory=list)
    items: list[ScheduledReq] = field(default_factory=list)
    prefills: list[bool] = field(default_factory=list)  # per item: Req.is_prefilling when it was added
    new_reqs: list[NewReqData] = field(default_factory=list)

    prefill_used: int = 0
    load_used: int = 0  # budget charged for host-tier loads (`add_load`)
    # images: which are encoded (None: all), and the step's encoding work (scheduler/image_encoding.py)
    image_ready: Callable[[ImageItem], bool] | None = None
    lora: LoraAdapters | None = None  # the adapters' device slots, taken as requests are admitted
    encode: list[EncodeWork] = field(default_factory=list)
    # full slots -> their slots in the sliding-window layers' own pool ([]: the model has no such pool)
    swa_of: Callable[[list[int]], list[int]] | None = None

    def fit_images(self, req: Req, n: int) -> int:
        """How many of req's next n prefill tokens the step may compute: up to its first image not yet
        encoded (never ending inside an image attended both ways)."""
        return req.chunk_end(n, self.image_ready) if req.images else n

    @property
    def prefill_budget(self) -> int:
        return min(self.budget, self.prefill_cap - self.prefill_used - self.load_used)

    def add_load(self, cost: int) -> None:
        """Charge a host -> device load to the step, against the prefill budget (loads come with
        admissions)."""
        self.load_used += cost
        self.budget -= cost

    def add(
        self,
        req: Req,
        n: int,
        slots: list[int],
        slot_start: int | None = None,
        prefix: list[int] | None = None,
        drafts: int = 0,
    ) -> None:
        """Schedule n tokens of req whose KV slots were just allocated (a new request also sends its
        cached prefix's slots, from position 0); the last `drafts` of them are the worker's draft tokens,
        counted as if all will be accepted (spec_decode.rollback corrects that at commit)."""
        start = req.num_computed_tokens
        prefilling = req.is_prefilling
        self.prefills.append(prefilling)
        if prefilling:
            self.prefill_used += n
        req.num_computed_tokens += n
        sample = req.num_computed_tokens - drafts == req.seq_len and req.embed is None  # embeddings pool
        if sample:
            req.num_output_placeholders += 1 + drafts
        req.num_inflight_steps += 1
        self.budget -= n
        self.reqs.append(req)
        if slot_start is None:
            slot_start = start
        all_slots = (prefix or []) + slots
        assert req.req_pool_idx is not None
        swa = self.swa_of(all_slots) if self.swa_of is not None else []
        self.items.append(ScheduledReq(req.req_pool_idx, n, slot_start, all_slots, sample, drafts, swa))


@dataclass
class InflightStep:
    step_id: int
    reqs: list[Req]
    epochs: list[int]  # each req's retraction epoch at scheduling time: stale results are dropped
    num_tokens: list[int]
    num_drafts: list[int]  # of num_tokens, the draft tokens to verify
    prefills: list[bool]  # each req's is_prefilling when the step was formed
    samplers: list[int]  # indices into reqs of those that sample, in result order
    needs_sample: bool = False  # structured output: the worker waits for a SampleStep with the bitmask
    sample_sent: bool = False


def to_output(step_id: int, freed_rows: list[int], plan: StepPlan) -> tuple[SchedulerOutput, InflightStep]:
    samplers = [i for i, it in enumerate(plan.items) if it.sample]
    defer = any(plan.reqs[i].grammar is not None for i in samplers)
    out = SchedulerOutput(step_id, freed_rows, plan.new_reqs, plan.items, defer_sample=defer,
                          encode=plan.encode)
    record = InflightStep(
        step_id,
        plan.reqs,
        [r.epoch for r in plan.reqs],
        [it.num_tokens for it in plan.items],
        [it.num_drafts for it in plan.items],
        plan.prefills,
        samplers,
        needs_sample=defer,
    )
    return out, record

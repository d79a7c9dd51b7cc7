"""Speculative decoding, the scheduler's side: how many draft tokens a decode step verifies, and the
rollback when the worker accepts fewer than it was given.

A request with drafts is scheduled as 1 + D query tokens; its counters move as if every draft will be
accepted (so with async scheduling the next step can be formed before this one's result is back) and
`rollback` moves them back by the rejected ones at commit. The worker proposes the drafts itself, on
the device, right after sampling: the scheduler never sees them, only how many were accepted.

The scheduler holds a `Speculation` only when a speculative method is configured: without one, the step
path never comes here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.scheduler.kv_cache import KVCacheManager
from tandem.scheduler.req import Req


@dataclass
class SpecStats:
    num_drafts: int = 0  # verify steps of a request with at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j

    def record(self, drafts: int, accepted: int) -> None:
        self.num_drafts += drafts > 0
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        if len(self.accepted_at) < drafts:
            self.accepted_at += [0] * (drafts - len(self.accepted_at))
        for j in range(accepted):
            self.accepted_at[j] += 1


class Speculation:
    def __init__(self, k: int, kv: KVCacheManager, stats: SpecStats) -> None:
        self.k = k  # draft tokens a decode step may verify
        self.kv = kv
        self.stats = stats

    def num_drafts(self, req: Req) -> int:
        """Draft tokens for req's next decode step: up to k, never past max_tokens. None where verifying
        them could change the output: a grammar (the bitmask is built for one position), penalties,
        min_tokens suppression or logprobs (each depends on the position within the step)."""
        if req.grammar is not None:
            return 0
        p = req.params
        if p.logprobs is not None or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            return 0
        if p.min_tokens > len(req.output_ids):
            return 0  # committed outputs: in-flight drafts may be rejected, leaving suppression still due
        return max(0, min(self.k, req.max_new_tokens - req.num_outputs_optimistic - 1))

    def commit(self, req: Req, drafts: int, verified: int, accepted: int) -> None:
        """At commit, a request scheduled with `drafts` drafts: the worker verified `verified` of them
        (fewer where its proposer matched nothing) and accepted `accepted`. The rest, skipped or rejected,
        roll back."""
        if drafts:
            self.stats.record(verified, accepted)
            req.spec_accepted_tokens += accepted
            rollback(req, self.kv, drafts, accepted)


def rollback(req: Req, kv: KVCacheManager, drafts: int, accepted: int) -> None:
    """The step computed 1 + drafts tokens of req and committed them all; `accepted` drafts were right.
    The rejected ones' KV is not the request's: computed counters move back and the tail of its KV
    allocation returns to the pool. With a later step in flight (async) that step's optimistic tokens
    simply shift down onto the freed positions: only the tail beyond them is given back."""
    rejected = drafts - accepted
    if rejected <= 0:
        return
    req.num_computed_tokens -= rejected
    req.kv_committed_len -= rejected
    kv.shrink(req, rejected)

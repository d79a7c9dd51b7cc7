"""Prompt logprobs as the worker returns them, chunk by chunk, into the client's deltas: each prompt
position delivered once, also when a retracted request computes its prompt again."""
from __future__ import annotations

from collections.abc import Callable

from protocol.messages import Logprobs, TokenDelta
from scheduler.req import Req
from scheduler.step_plan import InflightStep


def take_prompt_logprobs(step: InflightStep, by_row: dict[int, Logprobs], delta: Callable[[Req], TokenDelta]) -> None:
    """by_row: the step's prompt logprobs per request row; delta(req): this commit's delta of req."""
    for req, epoch in zip(step.reqs, step.epochs):
        lp = by_row.get(req.req_pool_idx) if epoch == req.epoch and not req.finished() else None
        if lp is None or not lp.token_ids:
            continue
        seen_before = req.prompt_lp_seen_this_epoch
        req.prompt_lp_seen_this_epoch += len(lp.token_ids)
        skip = max(0, req.prompt_lp_delivered - seen_before)
        if skip >= len(lp.token_ids):
            continue
        if skip:
            lp = Logprobs(lp.token_ids[skip:], lp.logprobs[skip:], lp.top_ids[skip:], lp.top_logprobs[skip:])
        req.prompt_lp_delivered += len(lp.token_ids)
        delta(req).prompt_logprobs = lp

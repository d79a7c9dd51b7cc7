"""Prompt logprobs of a committed step: each prompt position delivered to its client once, though a
retracted request computes its prompt again."""
from __future__ import annotations

from tandem.protocol.messages import Logprobs
from tandem.scheduler.req import Req
from tandem.scheduler.step_plan import InflightStep


def new_prompt_logprobs(step: InflightStep, by_row: dict[int, Logprobs]) -> list[tuple[Req, Logprobs]]:
    """The positions of by_row (the worker's, per request row) not yet delivered, per request."""
    out: list[tuple[Req, Logprobs]] = []
    for req, epoch in zip(step.reqs, step.epochs):
        lp = by_row.get(req.req_pool_idx) if epoch == req.epoch and not req.finished() else None  # type: ignore
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
        out.append((req, lp))
    return out



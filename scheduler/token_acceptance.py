"""One sampled token committed to its request: the output, the first token's time, the client's delta, and
what the token completes (a stop string, the grammar's end, or the grammar's refusal). Socket-free; the
scheduler's commit calls it for each token a step sampled, up to the first that ends the request."""

from __future__ import annotations

import time

from tandem.protocol import fault_injection
from tandem.protocol.errors import ErrorCode
from tandem.protocol.messages import Logprobs
from tandem.scheduler.delta_assembly import DeltaAssembly
from tandem.scheduler.finish import FinishReason
from tandem.scheduler.req import Req
from tandem.scheduler.stop_checker import StopChecker, StopMatch


def accept_token(
    req: Req, tok: int, lp: Logprobs | None, deltas: DeltaAssembly, stops: StopChecker
) -> tuple[StopMatch | None, bool]:
    """(the stop string the token completed, whether the grammar terminated); a token the grammar refuses
    sets the request's to_finish."""
    if fault_injection.ARMED:
        fault_injection.check("scheduler.commit", req.origin_input_ids)
    if not req.output_ids:
        req.time_stats.first_token = time.time()
    req.output_ids.append(tok)
    deltas.token(req.rid, tok, lp)
    matched = None
    if req.params.stop and len(req.output_ids) >= req.params.min_tokens:
        matched = stops.find(req.origin_input_ids, req.output_ids, req.params)
    grammar_done = False
    if req.grammar is not None:
        if not req.grammar.accept(tok):
            req.to_finish = FinishReason.error(
                f"the grammar cannot accept token {tok} after {len(req.output_ids) - 1} outputs",
                ErrorCode.GRAMMAR_REJECTED,
            )
        grammar_done = req.grammar.is_terminated()
    return matched, grammar_done

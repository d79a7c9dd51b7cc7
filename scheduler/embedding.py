"""Embedding requests on the scheduler's side: a Req that prefills its prompt and samples nothing; the
worker pools the hidden states and sends the vector with the step that computed the last prompt token,
and the commit of that step ends the request (its KV released with it)."""
from __future__ import annotations

from tandem.protocol.final_info import FinalInfo
from tandem.protocol.messages import EmbeddingBatch, EmbeddingOutput, EngineLoad
from tandem.scheduler.finish import FinishReason
from tandem.scheduler.req import Req
from tandem.scheduler.step_plan import InflightStep


def take_embeddings(step: InflightStep, by_row: dict[int, bytes]) -> None:
    """The requests of `step` whose vector came back are done: each ends with this commit."""
    for req, epoch in zip(step.reqs, step.epochs):
        vec = by_row.get(req.req_pool_idx) if epoch == req.epoch and not req.finished() else None
        if vec is not None and req.to_finish is None:  # an abort that raced it wins
            req.embedding = vec
            req.to_finish = FinishReason.stop()


def embedding_output(req: Req) -> EmbeddingOutput:
    """The request's one answer (an aborted one's vector is empty)."""
    reason = req.finished_reason
    assert reason is not None
    final = FinalInfo(reason.kind, None, len(req.origin_input_ids), 0, req.cached_tokens, 0, req.time_stats)
    return EmbeddingOutput(req.rid, req.embedding, final)


class EmbeddingOutbox:
    """Finished embedding requests' answers, sent together once the commit (or abort) is done."""

    def __init__(self) -> None:
        self.pending: list[EmbeddingOutput] = []

    def add(self, req: Req) -> None:
        self.pending.append(embedding_output(req))

    def take(self, load: EngineLoad) -> EmbeddingBatch:
        """The batch, the engine's gauges on its last answer (as the HTTP door's metrics read them)."""
        out, self.pending = self.pending, []
        out[-1].load = load
        return EmbeddingBatch(out)

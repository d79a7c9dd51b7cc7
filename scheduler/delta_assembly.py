"""What a commit tells the detokenizer: one TokenDelta per request it touched (new tokens and their
logprobs, prompt logprobs, and, once, how the request ended), sent together as one TokenBatch stamped with
the engine's load when the commit ends. The scheduler decides; this only assembles."""

from __future__ import annotations

from tandem.protocol.final_info import FinalInfo
from tandem.protocol.messages import EngineLoad, Logprobs, TokenBatch, TokenDelta
from tandem.scheduler.req import Req


class DeltaAssembly:
    def __init__(self) -> None:
        self._deltas: list[TokenDelta] = []
        self._of: dict[str, TokenDelta] = {}

    def __bool__(self) -> bool:
        return bool(self._deltas)

    def of(self, rid: str) -> TokenDelta:
        """This commit's delta for rid (one per request per commit)."""
        d = self._of.get(rid)
        if d is None:
            d = self._of[rid] = TokenDelta(rid, [])
            self._deltas.append(d)
        return d

    def token(self, rid: str, tok: int, lp: Logprobs | None) -> None:
        d = self.of(rid)
        d.token_ids.append(tok)
        if lp is not None:
            d.logprobs = lp if d.logprobs is None else (d.logprobs.extend(lp) or d.logprobs)

    def finish(self, req: Req) -> None:
        """How req ended: made here once, carried unchanged to the client."""
        reason = req.finished_reason
        assert reason is not None
        d = self.of(req.rid)
        d.final = FinalInfo(
            reason.kind, reason.matched, len(req.origin_input_ids), len(req.output_ids), req.cached_tokens,
            req.spec_accepted_tokens, req.time_stats, req.prefix_source,
        )
        d.stop_cut = reason.cut

    def take(self, load: EngineLoad) -> TokenBatch:
        for d in self._deltas:
            d.load = load
        batch = TokenBatch(self._deltas)
        self._deltas, self._of = [], {}
        return batch

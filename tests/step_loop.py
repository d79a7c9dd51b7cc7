"""A worker's steps driven in-process by a scheduler, no sockets: the tokens each request got."""
from __future__ import annotations

from tandem import SamplingParams
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import TokenBatch, TokenizedRequest
from tandem.protocol.model_info import ModelInfo
from tandem.scheduler.scheduler import Scheduler


def generate(cfg: EngineConfig, info: ModelInfo, runner, prompts: list[list[int]],
             params: list[SamplingParams], deltas: list | None = None) -> dict[str, list[int]]:
    """Request i is prompts[i] with params[i % len(params)], id f"r{i}"; runs until every one ends and checks
    the scheduler's integrity after. deltas: every TokenDelta is appended to it (logprobs and all)."""
    sched = Scheduler(cfg, info, runner.num_kv_slots, num_swa_slots=runner.num_swa_slots)
    for i, p in enumerate(prompts):
        sched.add_request(TokenizedRequest(f"r{i}", p, params[i % len(params)]))
    tokens: dict[str, list[int]] = {}
    while sched.has_work:
        so = sched.schedule()
        if so is None:
            break
        sched.commit(runner.execute(so))
        for msg in sched.take_outbox():
            if isinstance(msg, TokenBatch):
                for d in msg.deltas:
                    tokens.setdefault(d.rid, []).extend(d.token_ids)
                    if deltas is not None:
                        deltas.append(d)
    sched.check_integrity()
    return tokens

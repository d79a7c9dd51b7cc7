"""The pipeline step, free of sockets: drain -> schedule up to the pipeline depth -> send due samples ->
commit. The scheduler process feeds it what its sockets receive and sends what it returns; the
fake-worker tests drive the same object.

A batch queue of depth 2 (async scheduling) keeps the next step queued at the worker while the
previous result comes back; depth 1 is synchronous scheduling with the same code.
"""
from __future__ import annotations

import math
import time

import msgspec

from tandem.protocol.lora_messages import LoadLora, LoraReply, UnloadLora
from tandem.protocol.messages import (
    AbortRequest,
    CloseSession,
    EngineStats,
    ModelRunnerOutput,
    OpenSession,
    RequestError,
    SampleStep,
    SchedulerOutput,
    SessionReply,
    StatsRequest,
    StepFailed,
    TokenizedRequest,
)
from tandem.scheduler.lora_calls import load_lora, settle_loras, unload_lora
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.step_stats import StepStats


class StepDriver:
    def __init__(self, sched: Scheduler, depth: int) -> None:
        self.sched = sched
        self.depth = depth
        self.stats = StepStats()
        self._stalled = False  # the last schedule() found nothing to run: don't spin on it
        self._idle = True  # nothing to do since the last step: the next one starts a burst

    # ---- in ------------------------------------------------------------------------------------
    def on_request(
        self, msg: TokenizedRequest | AbortRequest | StatsRequest | OpenSession | CloseSession | LoadLora
        | UnloadLora,
    ) -> EngineStats | SessionReply | LoraReply | RequestError | None:
        """A frontend message; stats, session and adapter calls are answered at once (the reply goes to the
        detokenizer), but an unload that waits for its adapter's requests (its reply comes with a commit)."""
        if isinstance(msg, TokenizedRequest):
            self.sched.add_request(msg)
        elif isinstance(msg, AbortRequest):
            self.sched.abort(msg.rid)
        elif isinstance(msg, StatsRequest):
            return self.engine_stats(msg.rid)
        elif isinstance(msg, OpenSession):
            return self.sched.sessions.on_open(msg)
        elif isinstance(msg, CloseSession):
            return self.sched.sessions.on_close(msg)
        elif isinstance(msg, LoadLora):
            return load_lora(self.sched, msg)
        elif isinstance(msg, UnloadLora):
            return unload_lora(self.sched, msg)
        return None

    def on_result(self, msg: ModelRunnerOutput | StepFailed) -> list[SampleStep]:
        """Commit a step's result (or its failure on the worker); the next step's deferred sample may now
        be due."""
        if isinstance(msg, StepFailed):
            self.sched.fail_step(msg)
        else:
            self.sched.commit(msg)
            self.stats.on_result(msg)
        return self._due_samples()

    # ---- out -----------------------------------------------------------------------------------
    def poll_timeout_ms(self) -> int | None:
        """How long the process loop may wait for a message: forever when idle, 0 when a step can go."""
        busy = self.sched.has_work or bool(self.sched.inflight)
        if not busy:
            self._idle = True
        timeout = None if not busy else (0 if self._can_schedule() and not self._stalled else 50)
        if self.sched.structured.compiling:
            timeout = 2 if timeout is None else min(timeout, 2)  # wake up for finished compilations
        deadline = self.sched.sessions.next_deadline()
        if deadline is not None:  # wake up to time the session out
            wait = max(0, math.ceil((deadline - self.sched.sessions.clock()) * 1000))
            timeout = wait if timeout is None else min(timeout, wait)
        return timeout

    def pump(self) -> list[SchedulerOutput | SampleStep]:
        """Admit finished compilations, then schedule up to the pipeline depth: the messages for the
        workers, in order."""
        if self.sched.structured.compiling:
            self.sched.admit_compiled()
        self.sched.sessions.expire()
        settle_loras(self.sched)  # an unload out of time answers even while nothing commits
        out: list[SchedulerOutput | SampleStep] = list(self._due_samples())
        while self._can_schedule():
            t0 = time.perf_counter()
            step = self.sched.schedule()
            self._stalled = step is None
            if step is None:
                break
            step.after_idle, self._idle = self._idle, False
            out.append(step)
            self.stats.on_schedule(time.perf_counter() - t0)
            out += self._due_samples()
        return out

    def take_outbox(self) -> list[msgspec.Struct]:
        """Messages for the detokenizer, in order."""
        return self.sched.take_outbox()

    # ---- internals ------------------------------------------------------------------------------
    def _can_schedule(self) -> bool:
        # A deferred step's sample must reach the worker before the next step (which reads its tokens).
        waiting_sample = any(s.needs_sample and not s.sample_sent for s in self.sched.inflight)
        return self.sched.has_work and len(self.sched.inflight) < self.depth and not waiting_sample

    def _due_samples(self) -> list[SampleStep]:
        """The oldest step in flight has everything before it committed: its bitmask can be built."""
        inflight = self.sched.inflight
        if inflight and inflight[0].needs_sample and not inflight[0].sample_sent:
            return [self.sched.build_sample(inflight[0])]
        return []

    def engine_stats(self, rid: str) -> EngineStats:
        s, st, kv = self.sched.stats, self.stats, self.sched.kv
        try:
            self.sched.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = str(e)
        return EngineStats(
            rid=rid,
            kv_pool_size=kv.allocator.size,
            kv_free=kv.num_free_slots,
            kv_cached=kv.tree.evictable_size,
            kv_cache_locked=kv.tree.protected_size,
            running=len(self.sched.running),
            waiting=len(self.sched.waiting),
            inflight_steps=len(self.sched.inflight),
            requests_finished=s.finished,
            requests_aborted=s.aborted,
            requests_failed=s.failed,
            retractions=s.retractions,
            steps=s.steps,
            prefill_tokens=s.prefill_tokens,
            decode_tokens=s.decode_tokens,
            schedule_s=st.schedule_s,
            worker_busy_s=st.worker_busy_s,
            worker_idle_s=st.worker_idle_s,
            images_encoded=st.images_encoded,
            loras=self.sched.lora.served() if self.sched.lora else {},
            integrity=integrity,
            host_hit_tokens=kv.host_hit_tokens,
            host_kv_pool_size=kv.tree.host_size,
            host_kv_used=kv.tree.host_used,
            sessions_open=len(self.sched.sessions.sessions),
            session_held_tokens=self.sched.sessions.held_tokens(),
            swa_kv_pool_size=0 if kv.hybrid is None else kv.hybrid.swa.size,
            swa_kv_free=0 if kv.hybrid is None else kv.hybrid.swa.num_free,
            spec_draft_tokens=self.sched.spec.draft_tokens,
            spec_accepted_tokens=self.sched.spec.accepted_tokens,
            spec_accepted_per_position=list(self.sched.spec.accepted_at),
            grammar_cache_bytes=self.sched.structured.cached_bytes,
            worker_heap=st.worker_heap,
        )

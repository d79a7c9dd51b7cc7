"""The scheduler process: requests from the frontend, steps to the workers, tokens to the detokenizer.

A batch queue of depth 2 (async scheduling) keeps the next step queued at the worker while the
previous result comes back; depth 1 is synchronous scheduling with the same code.
"""
from __future__ import annotations

import os
import sys
import time

import zmq

from protocol.child import reporting_startup, start_child
from protocol.codec import encode, scheduler_in_decoder, worker_out_decoder
from protocol.engine_config import EngineConfig
from protocol.ipc import make_socket
from protocol.messages import (
    AbortReq,
    EngineStats,
    ModelRunnerOutput,
    Ready,
    RequestFailed,
    StatsRequest,
    StepFailed,
    TokenizedRequest,
    WorkerFailure,
    WorkerReady,
)
from protocol.model_info import read_model_info
from scheduler.scheduler import Scheduler
from scheduler.step_stats import StepStats


def run_scheduler(cfg_bytes: bytes, ep_bytes: bytes) -> None:
    cfg, ep, ctx, launcher = start_child(cfg_bytes, ep_bytes)
    with reporting_startup(launcher, "scheduler"):
        info = read_model_info(cfg.model, cfg.max_model_len)
        reqs_in = make_socket(ctx, zmq.PULL, ep.scheduler_in, bind=True)
        results = make_socket(ctx, zmq.PULL, ep.scheduler_results, bind=True)
        # Rank 0 relays each step to the other tensor-parallel ranks (over torch.distributed), so only
        # it needs a socket here, and ranks on other nodes need none.
        workers = [make_socket(ctx, zmq.PUSH, ep.worker_in(0), bind=False)]
        detok = make_socket(ctx, zmq.PUSH, ep.detok_in, bind=False)
        hello = worker_out_decoder()(results.recv())
        if not isinstance(hello, WorkerReady):
            raise RuntimeError(f"expected WorkerReady from rank 0, got {type(hello).__name__}")
        sched = Scheduler(cfg, info, hello.num_kv_slots)
        launcher.send(encode(Ready("scheduler", 0, f"pid={os.getpid()}")))
    SchedulerLoop(cfg, sched, reqs_in, results, workers, detok).run()


class SchedulerLoop:
    def __init__(
        self,
        cfg: EngineConfig,
        sched: Scheduler,
        reqs_in: zmq.Socket,
        results: zmq.Socket,
        workers: list[zmq.Socket],
        detok: zmq.Socket,
    ) -> None:
        self.sched = sched
        self.depth = 2 if cfg.async_scheduling else 1
        self.reqs_in, self.results, self.workers, self.detok = reqs_in, results, workers, detok
        self.poller = zmq.Poller()
        self.poller.register(reqs_in, zmq.POLLIN)
        self.poller.register(results, zmq.POLLIN)
        self.decode_req = scheduler_in_decoder()
        self.decode_result = worker_out_decoder()
        self.stats = StepStats()
        self._stalled = False  # the last schedule() found nothing to run: don't spin on it
        self._idle = True  # nothing to do since the last step: the next one starts a burst

    def run(self) -> None:
        try:
            self._serve()
        except Exception as e:
            # A fault of this process: every waiting client is told why before it goes.
            self._fail_all(f"scheduler failed: {type(e).__name__}: {e}")
            raise

    def _serve(self) -> None:
        while True:
            busy = self.sched.has_work or self.sched.inflight
            if not busy:
                self._idle = True
            timeout = None if not busy else (0 if self._can_schedule() and not self._stalled else 50)
            if self.sched.structured.compiling:
                timeout = 2 if timeout is None else min(timeout, 2)  # wake up for finished compilations
            events = dict(self.poller.poll(timeout))
            if self.reqs_in in events:
                self._drain_requests()
            if self.results in events:
                self._drain_results()
            if self.sched.structured.compiling:
                self.sched.admit_compiled()
            self._send_due_samples()
            while self._can_schedule():
                t0 = time.perf_counter()
                out = self.sched.schedule()
                self._stalled = out is None
                if out is None:
                    break
                out.after_idle, self._idle = self._idle, False
                data = encode(out)
                for w in self.workers:
                    w.send(data)
                self.stats.on_schedule(time.perf_counter() - t0)
                self._send_due_samples()
            self._flush()

    def _can_schedule(self) -> bool:
        # A deferred step's sample must reach the worker before the next step (which reads its tokens).
        waiting_sample = any(s.needs_sample and not s.sample_sent for s in self.sched.inflight)
        return self.sched.has_work and len(self.sched.inflight) < self.depth and not waiting_sample

    def _send_due_samples(self) -> None:
        """The oldest step in flight has everything before it committed: its bitmask can be built."""
        inflight = self.sched.inflight
        if inflight and inflight[0].needs_sample and not inflight[0].sample_sent:
            data = encode(self.sched.build_sample(inflight[0]))
            for w in self.workers:
                w.send(data)

    def _drain_requests(self) -> None:
        while True:
            try:
                data = self.reqs_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.decode_req(data)
            if isinstance(msg, TokenizedRequest):
                self.sched.add_request(msg)
            elif isinstance(msg, AbortReq):
                self.sched.abort(msg.rid)
            elif isinstance(msg, StatsRequest):
                self._flush()  # outputs of requests that ended before the snapshot go first
                self.detok.send(encode(self._stats(msg.rid)))

    def _stats(self, rid: str) -> EngineStats:
        s, st = self.sched.stats, self.stats
        try:
            self.sched.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = str(e)
        return EngineStats(
            rid, self.sched.kv.allocator.size, self.sched.kv.num_free_slots, self.sched.kv.tree.evictable_size,
            self.sched.kv.tree.protected_size, len(self.sched.running),
            len(self.sched.waiting), len(self.sched.inflight), s.finished, s.aborted, s.failed, s.retractions,
            s.steps, s.prefill_tokens, s.decode_tokens, st.schedule_s, st.worker_busy_s, st.worker_idle_s,
            integrity, host_hit_tokens=self.sched.kv.host_hit_tokens,
            host_kv_pool_size=self.sched.kv.tree.host_size, host_kv_used=self.sched.kv.tree.host_used,
        )

    def _drain_results(self) -> None:
        while True:
            try:
                data = self.results.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.decode_result(data)
            if isinstance(msg, WorkerFailure):
                self._fail_all(f"worker failed: {msg.message.splitlines()[0]}")
                print(f"scheduler: worker failed: {msg.message}", file=sys.stderr)
                raise SystemExit(1)
            if isinstance(msg, ModelRunnerOutput):
                self.sched.commit(msg)
                self.stats.on_result(msg)
                self._send_due_samples()
            elif isinstance(msg, StepFailed):
                print(f"scheduler: step {msg.step_id} failed: {msg.message}", file=sys.stderr)
                self.sched.fail_step(msg)
                self._send_due_samples()

    def _flush(self) -> None:
        for msg in self.sched.take_outbox():
            self.detok.send(encode(msg))

    def _fail_all(self, why: str) -> None:
        for rid in list(self.sched.reqs):
            self.detok.send(encode(RequestFailed(rid, "engine_dead", why)))
        self.sched.reqs.clear()
        # The sockets drop unsent messages on close (linger 0): give these a moment to leave.
        self.detok.close(linger=2000)

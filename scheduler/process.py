"""The scheduler process: requests from the frontend, steps to the workers, tokens to the detokenizer.
The pipeline policy lives in the socket-free StepDriver (scheduler/step_driver.py)."""
from __future__ import annotations

import os
import sys
import time

import zmq

from tandem.protocol.child import reporting_startup, start_child
from tandem.protocol.codec import encode, scheduler_in_decoder, worker_out_decoder
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode
from tandem.protocol.ipc import make_socket, ready_frames
from tandem.protocol.messages import (
    ModelRunnerOutput,
    Ready,
    RequestError,
    SampleStep,
    SchedulerOutput,
    StepFailed,
    WorkerReady,
)
from tandem.protocol.model_info import read_model_info
from tandem.protocol.stop_messages import Stalled, WorkerFailed
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.step_driver import StepDriver
from tandem.scheduler.step_watch import StepWatch
from tandem.scheduler.structured import start_compiler

STOP_WAIT_S = 30.0  # after a worker's failure, how long the launcher's stop may take before this process ends


def run_scheduler(cfg_bytes: bytes, ep_bytes: bytes) -> None:
    cfg, ep, ctx, launcher = start_child(cfg_bytes, ep_bytes)
    with reporting_startup(launcher, "scheduler"):
        info = read_model_info(cfg.model, cfg.max_model_len)
        # The grammar compiler loads (seconds) while the worker loads the model, and on after the engine is
        # ready.
        grammar = start_compiler(cfg.model, info.vocab_size)
        reqs_in = make_socket(ctx, zmq.PULL, ep.scheduler_in, bind=True)
        results = make_socket(ctx, zmq.PULL, ep.scheduler_results, bind=True)
        # Rank 0 relays each step to the other tensor-parallel ranks (over torch.distributed), so only
        # it needs a socket here, and ranks on other nodes need none.
        workers = [make_socket(ctx, zmq.PUSH, ep.worker_in(0), bind=False)]
        detok = make_socket(ctx, zmq.PUSH, ep.detok_in, bind=False)
        hello = worker_out_decoder()(results.recv())
        if not isinstance(hello, WorkerReady):
            raise RuntimeError(f"expected WorkerReady from rank 0, got {type(hello).__name__}")
        sched = Scheduler(cfg, info, hello.num_kv_slots, hello.num_host_slots, hello.num_swa_slots)
        sched.structured.adopt(grammar)
        launcher.send(encode(Ready("scheduler", 0, f"pid={os.getpid()}")))
    SchedulerLoop(cfg, sched, reqs_in, results, workers, detok, launcher).run()


class SchedulerLoop:
    """The sockets around a StepDriver: what they receive goes in, what it returns goes out."""

    def __init__(
        self,
        cfg: EngineConfig,
        sched: Scheduler,
        reqs_in: zmq.Socket,
        results: zmq.Socket,
        workers: list[zmq.Socket],
        detok: zmq.Socket,
        launcher: zmq.Socket | None = None,
    ) -> None:
        self.sched = sched
        self.driver = StepDriver(sched, depth=2 if cfg.async_scheduling else 1)
        self.reqs_in, self.results, self.workers, self.detok = reqs_in, results, workers, detok
        self.launcher = launcher  # where a stalled step is reported
        self.watch = StepWatch(cfg.step_timeout_s, cfg.startup_timeout_s)
        self.poller = zmq.Poller()
        self.poller.register(reqs_in, zmq.POLLIN)
        self.poller.register(results, zmq.POLLIN)
        self.decode_req = scheduler_in_decoder()
        self.decode_result = worker_out_decoder()

    def run(self) -> None:
        try:
            self._serve()
        except Exception as e:
            # A fault of this process: every waiting client is told why before it goes.
            self._fail_all(f"scheduler failed: {type(e).__name__}: {e}")
            raise

    def _serve(self) -> None:
        while True:
            events = dict(self.poller.poll(self.driver.poll_timeout_ms()))
            if self.reqs_in in events:
                self._drain_requests()
            if self.results in events:
                self._drain_results()
            self._to_workers(self.driver.pump())
            self._flush()
            self._check_stall()

    def _check_stall(self) -> None:
        # The poll wakes at least every 50 ms while a step is in flight (poll_timeout_ms), so this runs.
        waited = self.watch.overdue(time.monotonic())
        if waited is not None and self.sched.inflight:
            step = self.sched.inflight[0].step_id
            print(f"scheduler: step {step} has not come back after {waited:.1f} s", file=sys.stderr)
            if self.launcher is not None:
                self.launcher.send(encode(Stalled(step, waited, self.watch.limit_s)))

    def _flush(self) -> None:
        for msg in self.driver.take_outbox():
            self.detok.send(encode(msg))

    def _to_workers(self, msgs: list[SchedulerOutput | SampleStep]) -> None:
        if msgs:
            self.watch.sent(time.monotonic())
        for msg in msgs:
            data = encode(msg)
            for w in self.workers:
                w.send(data)

    def _drain_requests(self) -> None:
        for data in ready_frames(self.reqs_in):
            reply = self.driver.on_request(self.decode_req(data))
            if reply is not None:
                self._flush()  # outputs of requests that ended before the snapshot go first
                self.detok.send(encode(reply))

    def _drain_results(self) -> None:
        for data in ready_frames(self.results):
            msg = self.decode_result(data)
            if isinstance(msg, WorkerFailed):
                why = f"worker {msg.rank}: {msg.message}"
                print(f"scheduler: worker failed: {why}", file=sys.stderr, flush=True)
                if self.launcher is not None:
                    # The worker told the launcher too, which names the cause (it may be a peer's death
                    # this failure only echoes) to every waiting call and stops the engine within a second.
                    time.sleep(STOP_WAIT_S)
                self._fail_all(f"worker failed: {why}")  # nobody stopped us: say it ourselves
                raise SystemExit(1)
            if isinstance(msg, StepFailed):
                print(f"scheduler: step {msg.step_id} failed: {msg.message}", file=sys.stderr)
            if isinstance(msg, (ModelRunnerOutput, StepFailed)):
                follow = self.driver.on_result(msg)
                self.watch.result(time.monotonic(), bool(self.sched.inflight))
                self._to_workers(follow)

    def _fail_all(self, why: str) -> None:
        for rid in list(self.sched.reqs):
            self.detok.send(encode(RequestError(rid, ErrorCode.ENGINE_DEAD, why)))
        self.sched.reqs.clear()
        # The sockets drop unsent messages on close (linger 0): give these a moment to leave.
        self.detok.close(linger=2000)

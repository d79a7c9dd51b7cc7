"""The worker process: receives SchedulerOutputs, runs them in order, rank 0 replies.

With tensor parallelism only rank 0 has a ZMQ inbox; it forwards every message's bytes to the other
ranks (see worker/distributed.py), so all ranks run the same steps in the same order.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING

import zmq

from tandem.protocol import fault_injection
from tandem.protocol.child import reporting_startup, start_child
from tandem.protocol.codec import encode, worker_in_decoder
from tandem.protocol.heap_sample import HeapSample
from tandem.protocol.ipc import make_socket
from tandem.protocol.messages import (
    ModelRunnerOutput,
    Ready,
    SampleStep,
    SchedulerOutput,
    Shutdown,
    WorkerReady,
)
from tandem.protocol.model_info import read_model_info
from tandem.protocol.stop_messages import WorkerFailed
from tandem.worker.failed_step import FailedStep, survivable
from tandem.worker.heap_keeper import HeapKeeper

# A failed rank waits this long for the launcher's stop (it comes within about a second) before it exits.
STOP_WAIT_S = 30.0

if TYPE_CHECKING:
    from tandem.worker.distributed import Dist
    from tandem.worker.pending_step import PendingStep


class ControlInbox:
    """The zmq inbox's poll/recv, fed by rank 0's broadcast. Rank 0 receives from the scheduler and
    broadcasts; ranks > 0 always "have a message": they wait in the broadcast (their launched steps keep
    running on the device meanwhile)."""

    def __init__(self, dist: Dist, inbox: zmq.Socket | None) -> None:
        self.dist, self.inbox = dist, inbox

    def poll(self, timeout: int = 0) -> int:
        return self.inbox.poll(timeout) if self.inbox is not None else 1

    def recv(self) -> bytes:
        return self.dist.broadcast_bytes(self.inbox.recv() if self.inbox is not None else None)


def run_worker(cfg_bytes: bytes, ep_bytes: bytes, rank: int) -> None:
    cfg, ep, ctx, launcher = start_child(cfg_bytes, ep_bytes)
    with reporting_startup(launcher, f"worker{rank}"):
        from tandem.worker.malloc_tuning import keep_freed_memory

        keep_freed_memory()
        import torch

        from tandem.kernels.native.cpu_caps import usable_cores

        # The cores this process may use, shared by this node's ranks: the scheduler, frontend and
        # detokenizer sleep in their polls while the worker computes.
        torch.set_num_threads(cfg.torch_threads or max(1, usable_cores() // (cfg.tp_size // cfg.nnodes)))
        from tandem.kernels.reference.kv_quant import dtype_name as kv_dtype_name
        from tandem.worker.distributed import init_distributed
        from tandem.worker.model_runner import ModelRunner

        dist = init_distributed(cfg, ep, rank)  # None with tp_size == 1
        info = read_model_info(cfg.model, cfg.max_model_len)
        runner = ModelRunner(cfg, info, rank, dist)
        # Only rank 0 hears from the scheduler (remote nodes need no endpoint); the rest follow its broadcast.
        zmq_inbox = make_socket(ctx, zmq.PULL, ep.worker_in(rank), bind=True) if rank == 0 else None
        inbox = zmq_inbox if dist is None else ControlInbox(dist, zmq_inbox)
        results = make_socket(ctx, zmq.PUSH, ep.scheduler_results, bind=False) if rank == 0 else None
        if results is not None:
            results.send(encode(WorkerReady(runner.num_kv_slots, runner.max_reqs, runner.max_context,
                                         runner.num_host_slots, runner.num_swa_slots)))
        launcher.send(
            encode(
                Ready(
                    "worker",
                    rank,
                    f"kv_slots={runner.num_kv_slots} swa_kv_slots={runner.num_swa_slots} "
                    f"host_kv_slots={runner.num_host_slots} dtype={runner.dtype} "
                    f"kv_dtype={kv_dtype_name(runner.kv_dtype)} attention={runner.model.attn_backend.name} "
                    f"pid={os.getpid()}",
                )
            )
        )

    decode = worker_in_decoder()
    try:
        serve_steps(runner, inbox, results, decode)
    except Exception as e:
        # The scheduler stops sending steps; the launcher names the cause (this, or a peer's death this
        # only echoes) and stops the engine. Exiting now would race the report with this rank's own death.
        first = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"worker {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        failed = encode(WorkerFailed(rank, first))  # one message, to the scheduler and the launcher
        if results is not None:
            results.send(failed)
        launcher.send(failed)
        time.sleep(STOP_WAIT_S)
        raise SystemExit(1) from e
    if dist is not None:
        dist.close()  # after a clean Shutdown only: with a dead peer this could block


def serve_steps(
    runner, inbox: zmq.Socket | ControlInbox, results: zmq.Socket | None, decode
) -> None:
    """Launch steps in order; send each result as soon as its tokens are on the host.

    On CUDA a launch only queues work, so when the next step is already waiting it is launched before
    the previous result is read: the device runs N+1 while N's tokens travel back and are committed.
    On CPU a launched step is complete, and its result goes out at once.
    """
    pending: deque[PendingStep | FailedStep] = deque()
    heap = HeapKeeper(runner.cfg.heap_trim_period_s)
    idle_ms = heap.idle_poll_ms
    held: HeapSample | None = None  # taken while idle: goes out with the next step's result

    def send_oldest() -> None:
        nonlocal held
        out = pending.popleft().result()
        if isinstance(out, ModelRunnerOutput):  # a failed step's StepFailed carries no sample
            out.heap = heap.tick() or held
            held = None
        if results is not None:
            results.send(encode(out))

    while True:
        if not pending and idle_ms > 0 and inbox.poll(idle_ms) == 0:
            held = heap.tick() or held  # idle: give back what the last burst left held
            continue
        if pending and not pending[0].ready and inbox.poll(0) == 0:
            send_oldest()  # nothing new to queue: wait for the oldest step instead
            continue
        while pending and pending[0].ready:
            send_oldest()
        if pending and inbox.poll(0) == 0:
            continue
        msg = decode(inbox.recv())
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, SchedulerOutput):
            for r in msg.new_reqs:  # test-only: a fault no step survives (unset, a dict lookup)
                fault_injection.check("worker.fatal", r.token_ids[: r.num_prompt])
        try:
            step = runner.sample_deferred(msg) if isinstance(msg, SampleStep) else runner.launch(msg)
        except Exception as e:
            if not (runner.running_step and survivable(e, runner.cfg.tp_size)):
                raise  # not a step's fault (a protocol error) or ranks would diverge: the engine ends
            step = runner.fail(e)
        if step is not None:  # None: a deferred step, finished by its SampleStep (or failed already)
            pending.append(step)

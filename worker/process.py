"""The worker process: receives SchedulerOutputs, runs them in order, rank 0 replies."""
from __future__ import annotations

import os
import time
import traceback

import zmq

from protocol.codec import encode, worker_in_decoder
from protocol.engine_config import EngineConfig
from protocol.ipc import Endpoints, exit_with_parent, make_socket
from protocol.messages import Failed, Ready, SchedulerOutput, Shutdown, WorkerFailure, WorkerReady
from protocol.model_info import read_model_info


def run_worker(cfg_bytes: bytes, ep_bytes: bytes, rank: int) -> None:
    exit_with_parent()
    cfg = EngineConfig.decode(cfg_bytes)
    ep = Endpoints.decode(ep_bytes)
    ctx = zmq.Context()
    launcher = make_socket(ctx, zmq.PUSH, ep.launcher, bind=False)
    try:
        from worker.malloc_tuning import keep_freed_memory

        keep_freed_memory()
        import torch

        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        from worker.model_runner import ModelRunner

        info = read_model_info(cfg.model, cfg.max_model_len)
        runner = ModelRunner(cfg, info)
        inbox = make_socket(ctx, zmq.PULL, ep.worker_in(rank), bind=True)
        results = make_socket(ctx, zmq.PUSH, ep.scheduler_results, bind=False) if rank == 0 else None
        if results is not None:
            results.send(encode(WorkerReady(runner.num_kv_slots, runner.max_reqs, runner.max_context)))
        launcher.send(encode(Ready("worker", rank, f"kv_slots={runner.num_kv_slots} pid={os.getpid()}")))
    except Exception as e:  # noqa: BLE001 - report any startup failure to the launcher, then die
        launcher.send(encode(Failed(f"worker{rank}", f"{e}\n{traceback.format_exc()}")))
        raise SystemExit(1) from e

    decode = worker_in_decoder()
    idle_since = time.perf_counter()
    try:
        while True:
            msg = decode(inbox.recv())
            if isinstance(msg, Shutdown):
                return
            assert isinstance(msg, SchedulerOutput)
            idle = time.perf_counter() - idle_since
            out = runner.execute(msg)
            idle_since = time.perf_counter()
            out.idle_s = idle
            if results is not None:
                results.send(encode(out))
    except Exception as e:  # noqa: BLE001 - tell the scheduler why before dying
        if results is not None:
            results.send(encode(WorkerFailure(f"worker {rank}: {e}\n{traceback.format_exc()}")))
        raise SystemExit(1) from e

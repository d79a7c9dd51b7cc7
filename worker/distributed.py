"""Tensor-parallel process group: model collectives plus a gloo group for rank 0's control messages.

Rank 0 alone talks to the scheduler; it forwards each message's raw bytes to the other ranks over the
gloo group, so every rank runs the same step and remote nodes need no ZMQ endpoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.ipc import Endpoints

# A dead peer must not hang a model collective (or startup) forever.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# Ranks > 0 wait in the control broadcast while the engine is idle, for as long as it stays idle; a dead
# rank 0 still surfaces at once (gloo sees the connection close).
CONTROL_TIMEOUT = timedelta(days=3650)


@dataclass
class Dist:
    rank: int
    world_size: int
    control: dist.ProcessGroup  # gloo, CPU tensors: control bytes and small agreements

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 passes the bytes, every rank returns them: a length, then the payload."""
        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.control)
        size = int(n.item())
        if size == 0:
            return b""
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(
            size, dtype=torch.uint8
        )
        dist.broadcast(buf, src=0, group=self.control)
        return data if self.rank == 0 else buf.numpy().tobytes()  # type: ignore[return-value]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV slots: free memory differs between ranks)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def local_rank(cfg: EngineConfig, rank: int) -> int:
    """Rank within this node (its GPU index): nodes hold tp_size / nnodes consecutive ranks."""
    return rank % (cfg.tp_size // cfg.nnodes)


def init_distributed(cfg: EngineConfig, endpoints: Endpoints, rank: int) -> Dist | None:
    """Join the tp_size-rank group (None when tp_size == 1: no group, no overhead)."""
    if cfg.tp_size == 1:
        return None
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local_rank(cfg, rank))  # before NCCL init: one GPU per rank
    # One node: a file in the launch's private dir (no port to pick or collide); across nodes: node 0.
    init_file = os.path.join(endpoints.root, "dist_init")
    init = f"tcp://{cfg.dist_init_addr}" if cfg.dist_init_addr else f"file://{init_file}"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init, world_size=cfg.tp_size, rank=rank,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    # Sampling draws from the global RNG: the same seed keeps every rank's tokens (hence inputs) identical.
    torch.manual_seed(cfg.seed)
    return Dist(rank, cfg.tp_size, control)

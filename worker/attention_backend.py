"""Attention backends: how a layer stores its new K/V and attends over the paged KV pool.

The model asks its backend for a per-step plan once (`plan`: whatever every layer shares, worked out from
the batch's host-side lists) and then calls `forward` per layer. The backend is chosen by device and by
`EngineConfig.attention_backend`:

- `torch` (CPU default): the torch reference path; fresh prefills attend their own K/V as computed, so
  only decodes and prefixes are read from the pool.
- `torch-gather`: the previous CPU path (every request's K/V gathered from the pool), kept to measure
  against and as the plain reference.
- `triton` (CUDA default): kernels/paged_attention_triton.py, reading K/V where it lies; its launch
  reads nothing back from the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from kernels.paged_attention import AttentionPlan, build_attention_plan, paged_attention_ref
from worker.forward_batch import ForwardBatch
from worker.kv_cache import KVCache

BACKENDS = ("auto", "torch", "torch-gather", "triton")


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def plan(self, batch: ForwardBatch, kv: KVCache) -> Any:
        """What every layer of this step shares (built once per step)."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        """Store this step's k, v [T, Hkv, D] in the layer's pools, then attend: q [T, H, D] -> [T, H, D]."""


class TorchBackend(AttentionBackend):
    """The torch path. `fresh_in_place`: a prefill with no cached prefix attends the K/V it just computed
    instead of reading them back from the pool (the pool copy is only for later steps)."""

    def __init__(self, fresh_in_place: bool = True) -> None:
        self.fresh_in_place = fresh_in_place
        self.name = "torch" if fresh_in_place else "torch-gather"

    def plan(self, batch: ForwardBatch, kv: KVCache) -> TorchPlan:
        return TorchPlan(batch, build_attention_plan(
            kv.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
            seq_lens_cpu=batch.seq_lens_cpu, extend_lens_cpu=batch.extend_lens_cpu,
            req_pool_indices_cpu=batch.req_pool_indices_cpu,
        ))  # fmt: skip

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        b = plan.batch
        kv.write(layer_id, b.out_cache_loc, k, v)
        return paged_attention_ref(
            q, kv.k[layer_id], kv.v[layer_id], kv.req_to_token, b.req_pool_indices, b.seq_lens,
            b.extend_lens, scale, plan=plan.attn, new_kv=(k, v) if self.fresh_in_place else None,
        )  # fmt: skip


class TritonBackend(AttentionBackend):
    name = "triton"

    def plan(self, batch: ForwardBatch, kv: KVCache) -> TritonPlan:
        # Device tensors the kernels read and host ints for the grid: nothing is copied or read back.
        ext = batch.extend_lens
        return TritonPlan(batch, torch.cumsum(ext, 0) - ext, max(batch.extend_lens_cpu, default=0))

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        from kernels.paged_attention_triton import paged_attention_triton

        b = plan.batch
        kv.write(layer_id, b.out_cache_loc, k, v)
        return paged_attention_triton(
            q, kv.k[layer_id], kv.v[layer_id], kv.req_to_token, b.req_pool_indices, b.seq_lens,
            b.extend_lens, scale, cu_lens=plan.cu_lens, max_extend=plan.max_extend,
        )  # fmt: skip


@dataclass
class TorchPlan:
    batch: ForwardBatch
    attn: AttentionPlan


@dataclass
class TritonPlan:
    batch: ForwardBatch
    cu_lens: torch.Tensor  # [B] first row of each request in q
    max_extend: int


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: triton on CUDA, torch elsewhere. `triton` off CUDA needs TRITON_INTERPRET=1 (tests)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        return TritonBackend()
    return TorchBackend(fresh_in_place=name == "torch")

"""Attention backends: how a layer stores its new K/V and attends over the paged KV pool.

The model asks its backend for a per-step plan once (`plan`: whatever every layer shares, worked out from
the batch's host-side lists) and then calls `forward` per layer. A model with sliding-window layers asks for
a second plan that those layers share: their window, and, when they have a KV pool of their own
(KVCache.swa_map), the map from the table's slots to that pool's (where this step's K/V go, and which slots
the attention reads). The backend is the one kernels/ops.py resolved (`Ops.attention`, from
`EngineConfig.attention_backend`):

- `cpu` (CPU default): every query of the step (decodes, verify rows, prefills and chunks) attended in
  one call per layer by a C kernel that reads K/V where it lies in the pool
  (kernels/native/paged_attention.py), float32 queries over float32, float16, bfloat16 or q8_0 pools;
  where the C kernels do not run (a model dtype other than float32, no C compiler, TANDEM_NO_NATIVE=1) it
  runs as `torch`. A query's output depends on its own keys only, so a prompt prefilled whole, in chunks or
  beside other requests gives the same bits.
- `torch`: kernels/reference/paged_attention.py. Fresh prefills attend their own K/V as computed instead
  of gathering them back from the pool; decodes and the prefixes of chunked or cached prefills are gathered.
- `triton` (CUDA default): kernels/triton/paged_attention.py, reading K/V where it lies; its launch
  reads nothing back from the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kernels.native import paged_attention as cpu_paged_attention
from tandem.kernels.ops import Ops
from tandem.kernels.reference.paged_attention import AttentionPlan, build_attention_plan, paged_attention_ref
from tandem.kernels.triton.paged_attention import paged_attention_triton
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def plan(
        self, batch: ForwardBatch, kv: KVCache, window: int = 0, slot_map: torch.Tensor | None = None
    ) -> Any:
        """What every layer of this step shares (built once per step); window > 0: what the sliding-window
        layers share, slot_map their pool's slot for each of the table's (None: they use the table's)."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        """Store this step's k, v [T, Hkv, D] in the layer's pools, then attend: q [T, H, D] -> [T, H, D]."""


class TorchBackend(AttentionBackend):
    """The torch path: fresh prefills attend the K/V they just computed instead of reading them back."""

    name = "torch"

    def plan(self, batch: ForwardBatch, kv: KVCache, window: int = 0, slot_map: torch.Tensor | None = None,
             ) -> TorchPlan:
        return TorchPlan(batch, build_attention_plan(
            kv.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
            seq_lens_cpu=batch.seq_lens_cpu, extend_lens_cpu=batch.extend_lens_cpu,
            req_pool_indices_cpu=batch.req_pool_indices_cpu, window=window, slot_map=slot_map,
            image_spans=batch.image_spans,
        ), _loc(batch, slot_map))

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        b = plan.batch
        _write(kv, layer_id, plan, k, v)
        return paged_attention_ref(
            q, kv.k[layer_id], kv.v[layer_id], kv.req_to_token, b.req_pool_indices, b.seq_lens, b.extend_lens,
            scale, plan=plan.attn, new_kv=(k, v),
        )


class CpuBackend(TorchBackend):
    """All of a step's queries attended in the pool by the C kernel, one call per layer; the torch path where
    the C kernels do not run (`native`: Ops.native, resolved once)."""

    name = "cpu"

    def __init__(self, native: bool) -> None:
        self.native = native

    def plan(self, batch: ForwardBatch, kv: KVCache, window: int = 0, slot_map: torch.Tensor | None = None,
             ) -> TorchPlan | CpuPlan:
        if not self.native or batch.image_spans:  # images attended both ways: the torch path's masks
            return super().plan(batch, kv, window, slot_map)
        return CpuPlan(
            batch,
            cpu_paged_attention.plan_cpu_attention(
                kv.req_to_token,
                batch.req_pool_indices_cpu,
                batch.seq_lens_cpu,
                batch.extend_lens_cpu,
                window,
                slot_map,
            ),
            _loc(batch, slot_map),
        )

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        if isinstance(plan, TorchPlan):
            return super().forward(layer_id, q, k, v, kv, plan, scale)
        _write(kv, layer_id, plan, k, v, native=True)
        return cpu_paged_attention.paged_attention_cpu(q, kv.k[layer_id], kv.v[layer_id], plan.attn, scale)


class TritonBackend(AttentionBackend):
    name = "triton"

    def plan(self, batch: ForwardBatch, kv: KVCache, window: int = 0, slot_map: torch.Tensor | None = None,
             ) -> TritonPlan | TorchPlan:
        if batch.image_spans:  # images attended both ways: the torch path's masks
            return _TORCH.plan(batch, kv, window, slot_map)
        # Device tensors the kernels read and host ints for the grid: nothing is copied or read back.
        ext = batch.extend_lens
        return TritonPlan(batch, torch.cumsum(ext, 0) - ext, max(batch.extend_lens_cpu, default=0),
                          _loc(batch, slot_map), window, slot_map)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        if isinstance(plan, TorchPlan):
            return _TORCH.forward(layer_id, q, k, v, kv, plan, scale)
        b = plan.batch
        _write(kv, layer_id, plan, k, v)
        return paged_attention_triton(
            q, kv.k[layer_id], kv.v[layer_id], kv.req_to_token, b.req_pool_indices, b.seq_lens,
            b.extend_lens, scale, cu_lens=plan.cu_lens, max_extend=plan.max_extend, window=plan.window,
            slot_map=plan.slot_map,
        )


def _loc(batch: ForwardBatch, slot_map: torch.Tensor | None) -> torch.Tensor | None:
    """Where this step's K/V go in a pool of the sliding layers' own (None: the batch's slots)."""
    return None if slot_map is None else slot_map[batch.out_cache_loc]


def _write(kv: KVCache, layer_id: int, plan: Any, k: torch.Tensor, v: torch.Tensor, native: bool = False,
           ) -> None:
    """native: the C kernels run (KVCache.write's)."""
    kv.write(layer_id, plan.batch.out_cache_loc if plan.loc is None else plan.loc, k, v, native)


@dataclass
class TorchPlan:
    batch: ForwardBatch
    attn: AttentionPlan
    loc: torch.Tensor | None  # [T] this step's K/V slots in the sliding layers' own pool; None: the batch's


@dataclass
class CpuPlan:
    batch: ForwardBatch
    attn: cpu_paged_attention.CpuAttentionPlan
    loc: torch.Tensor | None


@dataclass
class TritonPlan:
    batch: ForwardBatch
    cu_lens: torch.Tensor  # [B] first row of each request in q
    max_extend: int
    loc: torch.Tensor | None
    window: int = 0
    slot_map: torch.Tensor | None = None


_TORCH = TorchBackend()


def select_attention_backend(ops: Ops) -> AttentionBackend:
    """The backend of ops.attention (kernels/ops.py resolved `auto` and checked the name)."""
    if ops.attention == "triton":
        return TritonBackend()
    if ops.attention == "cpu":
        return CpuBackend(ops.native)
    return TorchBackend()

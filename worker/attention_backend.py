"""Attention backends: how a layer stores its new K/V and attends over the paged KV pool.

The model asks its backend for a per-step plan once (`plan`: whatever every layer shares, worked out from
the batch's host-side lists) and then calls `forward` per layer. The backend is chosen by device and by
`EngineConfig.attention_backend`:

- `cpu` (CPU default): every query of the step (decodes, verify rows, prefills and chunks) attended in
  one call per layer by a C kernel that reads K/V where it lies in the pool
  (kernels/cpu_paged_attention.py), float32 only; a step it cannot take (another dtype, or no C compiler
  to build it) runs as `torch`. A query's output depends on its own keys only, so a prompt prefilled
  whole, in chunks or beside other requests gives the same bits.
- `torch`: fresh prefills attend their own K/V as computed instead of gathering them back from the
  pool; decodes and the prefixes of chunked or cached prefills are gathered.
- `torch-runs`: `torch`, and decodes attend their longest contiguous run of pool slots in place,
  gathering only the rest (kernels/decode_attention_runs.py). One call per request and layer: on the
  2-core machine it was measured on (busy with other work) it was slower than gathering, so not the
  default; `python -m benchmarks.attention_step` compares them on the machine at hand.
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

from kernels.decode_attention_runs import DecodeRuns, decode_attention_runs, plan_decode_runs
from kernels.native import paged_attention as cpu_paged_attention
from kernels.reference.paged_attention import AttentionPlan, build_attention_plan, paged_attention_ref
from worker.forward_batch import ForwardBatch
from worker.kv_cache import KVCache

BACKENDS = ("auto", "cpu", "torch", "torch-runs", "torch-gather", "triton")


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
    """The torch path. `in_place`: fresh prefills attend the K/V they just computed instead of reading
    them back from the pool; `decode_runs`: decodes read their longest run of slots in place."""

    def __init__(self, in_place: bool = True, decode_runs: bool = False) -> None:
        self.in_place, self.decode_runs = in_place, decode_runs
        self.name = ("torch-runs" if decode_runs else "torch") if in_place else "torch-gather"

    def plan(self, batch: ForwardBatch, kv: KVCache) -> TorchPlan:
        # Decode runs are found on the host copy of the table: the CPU backend's table is that copy.
        runs_ok = self.decode_runs and kv.req_to_token.device.type == "cpu"
        attn = build_attention_plan(
            kv.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.extend_lens,
            seq_lens_cpu=batch.seq_lens_cpu, extend_lens_cpu=batch.extend_lens_cpu,
            req_pool_indices_cpu=batch.req_pool_indices_cpu, decodes=not runs_ok,
        )  # fmt: skip
        runs = None
        if runs_ok:
            dec = [i for i, e in enumerate(batch.extend_lens_cpu) if e == 1]
            if dec:
                starts = batch.extend_starts_cpu
                runs = plan_decode_runs(
                    kv.req_to_token, [batch.req_pool_indices_cpu[i] for i in dec],
                    [batch.seq_lens_cpu[i] for i in dec], [starts[i] for i in dec], batch.all_decode,
                )  # fmt: skip
        return TorchPlan(batch, attn, runs)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        b = plan.batch
        kv.write(layer_id, b.out_cache_loc, k, v)
        k_pool, v_pool = kv.k[layer_id], kv.v[layer_id]
        runs = plan.runs
        if runs is not None and runs.token_idx is None:  # every request decodes
            return decode_attention_runs(q, k_pool, v_pool, runs, scale)
        out = paged_attention_ref(
            q, k_pool, v_pool, kv.req_to_token, b.req_pool_indices, b.seq_lens, b.extend_lens, scale,
            plan=plan.attn, new_kv=(k, v) if self.in_place else None,
        )  # fmt: skip
        if runs is not None:
            out.index_copy_(0, runs.token_idx, decode_attention_runs(
                q.index_select(0, runs.token_idx), k_pool, v_pool, runs, scale))  # fmt: skip
        return out


class CpuBackend(TorchBackend):
    """All of a step's queries attended in the pool by the C kernel, one call per layer; the torch plan for
    a step whose pool is not float32 on CPU or when the kernel is unavailable."""

    def __init__(self) -> None:
        super().__init__(in_place=True)
        self.name = "cpu"
        cpu_paged_attention.available()  # build (or find) the kernel now, not in the first request's step

    def plan(self, batch: ForwardBatch, kv: KVCache) -> TorchPlan | CpuPlan:
        if not (kv.dtype == torch.float32 and kv.req_to_token.device.type == "cpu" and cpu_paged_attention.available()):
            return super().plan(batch, kv)
        return CpuPlan(batch, cpu_paged_attention.plan_cpu_attention(
            kv.req_to_token, batch.req_pool_indices_cpu, batch.seq_lens_cpu, batch.extend_lens_cpu))  # fmt: skip

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        if isinstance(plan, TorchPlan):
            return super().forward(layer_id, q, k, v, kv, plan, scale)
        kv.write(layer_id, plan.batch.out_cache_loc, k, v)
        return cpu_paged_attention.paged_attention_cpu(q, kv.k[layer_id], kv.v[layer_id], plan.attn, scale)


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
        from kernels.triton.paged_attention import paged_attention_triton

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
    runs: DecodeRuns | None  # the decodes, when the backend attends them run by run


@dataclass
class CpuPlan:
    batch: ForwardBatch
    attn: cpu_paged_attention.CpuAttentionPlan


@dataclass
class TritonPlan:
    batch: ForwardBatch
    cu_lens: torch.Tensor  # [B] first row of each request in q
    max_extend: int


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: triton on CUDA, cpu elsewhere. `triton` off CUDA needs TRITON_INTERPRET=1 (tests)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "triton":
        return TritonBackend()
    if name == "cpu":
        return CpuBackend()
    return TorchBackend(in_place=name != "torch-gather", decode_runs=name == "torch-runs")

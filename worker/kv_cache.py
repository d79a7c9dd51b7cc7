"""Paged KV cache: per-layer K and V pools addressed by slot, plus each request's token -> slot map, and
the host tier under the prefix cache: a second, larger pool in host memory (pinned on CUDA) that evicted
KV is copied to and loaded back from.

The pools' element is --kv-cache-dtype's: a float dtype, or uint8 for q8_0 blocks (kernels/reference/
kv_quant.py), whose slot rows are bytes [kv_heads, head_dim / 32 * 34]: every copy of slots along dim 0 (the
host tier's, zero fill) moves them as it moves float rows."""

from __future__ import annotations

import torch

from tandem.kernels.native import paged_attention as cpu_paged_attention
from tandem.kernels.reference.kv_quant import is_q8_0, pool_width, to_pool
from tandem.protocol.messages import KVCopies
from tandem.worker.zero_pages import zeroed


def host_runs(host_slots: list[int]) -> list[tuple[int, int, int]]:
    """Split a slot list into runs of consecutive slots: (i, j, first) with host_slots[i:j] ==
    range(first, first + j - i). A run is one contiguous view of the host pool, so its copy is one DMA
    that needs no host-side gather (which would have to wait for earlier copies into the pool)."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    for j in range(1, len(host_slots) + 1):
        if j == len(host_slots) or host_slots[j] != host_slots[j - 1] + 1:
            runs.append((i, j, host_slots[i]))
            i = j
    return runs


def _host_pool(shape: tuple[int, int, int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host-tier pool: pinned for a GPU's copies, else the mapping that costs nothing until written."""
    return torch.zeros(shape, dtype=dtype, pin_memory=True) if pin else zeroed(shape, dtype)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_reqs: int = 256,
        max_context: int = 4096,
        host_slots: int = 0,
        swa_slots: int = 0,
        swa_layers: frozenset[int] = frozenset(),
    ) -> None:
        """dtype: the pools' (uint8: q8_0, which needs head_dim a multiple of 32: ValueError otherwise).
        swa_slots > 0: the layers in swa_layers (sliding-window ones) get pools of that many slots of their
        own, addressed through swa_map (full slot -> slot there, written by the scheduler's steps)."""
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.swa_slots = swa_slots
        self.swa_map = torch.zeros(num_slots, dtype=torch.int64, device=device) if swa_slots else None
        width = pool_width(dtype, head_dim)

        def shape(layer: int) -> tuple[int, int, int]:
            return (swa_slots if swa_slots and layer in swa_layers else num_slots, num_kv_heads, width)

        # Zero-filled, not empty: attention pads short requests with slot 0 and masks it out, and a masked
        # score times a NaN left over in uninitialised memory would still poison the output.
        self.k: list[torch.Tensor] = [zeroed(shape(i), dtype, device) for i in range(num_layers)]
        self.v: list[torch.Tensor] = [zeroed(shape(i), dtype, device) for i in range(num_layers)]
        # Row r, column j: KV slot of token j of the request living in row r. The engine fills it.
        self.req_to_token = zeroed((max_reqs, max_context), torch.int64, device)
        pin = self.device.type == "cuda"
        host_shape = (host_slots, num_kv_heads, width)
        self.host_k = [_host_pool(host_shape, dtype, pin) for _ in range(num_layers if host_slots else 0)]
        self.host_v = [_host_pool(host_shape, dtype, pin) for _ in range(num_layers if host_slots else 0)]

    def map_swa(self, slots: torch.Tensor, swa_slots: torch.Tensor) -> None:
        """Record where the sliding-window layers keep the KV of these full slots (the scheduler's map)."""
        assert self.swa_map is not None
        self.swa_map.index_copy_(0, slots, swa_slots)

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, native: bool = False,
              ) -> None:
        """Store this step's K/V ([T, num_kv_heads, head_dim]) into slots `loc` ([T]), rounded to the pool's
        dtype (--kv-cache-dtype) to nearest even, as torch's .to() does, or quantized to q8_0 blocks.
        native: where the C kernels run, q8_0 blocks are quantized by the C write (the same bytes as torch's,
        for a fraction of the ops)."""
        if is_q8_0(self.dtype) and native and k.dtype == torch.float32 and self.device.type == "cpu":
            cpu_paged_attention.store_rows(self.k[layer], loc, k)
            cpu_paged_attention.store_rows(self.v[layer], loc, v)
            return
        self.k[layer].index_copy_(0, loc, to_pool(k, self.dtype))
        self.v[layer].index_copy_(0, loc, to_pool(v, self.dtype))

    def copy(self, c: KVCopies) -> None:
        """Run a step's host-tier copies: all device -> host first (their device slots may be reused by
        the loads and by this step's forward), then host -> device."""
        if (c.to_host_src or c.to_device_src) and not self.host_k:
            raise RuntimeError("KV copies for a host tier this worker does not have (--host-kv-tokens)")
        pairs = ((self.k, self.host_k), (self.v, self.host_v))
        if self.device.type != "cuda":  # one pool in RAM like the other: a gather and a scatter per layer
            if c.to_host_src:
                src, dst = torch.tensor(c.to_host_src), torch.tensor(c.to_host_dst)
                for pool, host in pairs:
                    for layer, hpool in zip(pool, host):
                        hpool.index_copy_(0, dst, layer.index_select(0, src))
            if c.to_device_src:
                src, dst = torch.tensor(c.to_device_src), torch.tensor(c.to_device_dst)
                for pool, host in pairs:
                    for layer, hpool in zip(pool, host):
                        layer.index_copy_(0, dst, hpool.index_select(0, src))
            return
        # CUDA: each run of consecutive host slots is one async DMA to or from pinned memory, queued on
        # the step's stream, so the copies are ordered with the forwards around them and never make the
        # host wait (a host-side gather would have to wait for earlier copies into the pool).
        if c.to_host_src:
            src = torch.tensor(c.to_host_src, dtype=torch.int64).to(self.device, non_blocking=True)
            for i, j, h in host_runs(c.to_host_dst):
                for pool, host in pairs:
                    for layer, hpool in zip(pool, host):
                        hpool[h : h + j - i].copy_(layer.index_select(0, src[i:j]), non_blocking=True)
        if c.to_device_src:
            dst = torch.tensor(c.to_device_dst, dtype=torch.int64).to(self.device, non_blocking=True)
            for i, j, h in host_runs(c.to_device_src):
                for pool, host in pairs:
                    for layer, hpool in zip(pool, host):
                        layer.index_copy_(
                            0, dst[i:j], hpool[h : h + j - i].to(self.device, non_blocking=True)
                        )

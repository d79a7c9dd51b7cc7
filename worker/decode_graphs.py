"""Decode steps replayed from captured CUDA graphs.

A decode step (every request one new token and one logit row) launches some ten kernels per layer; for a
small model on a fast GPU the launches, not the math, set the step time. So the model's forward up to the
LM head (`hidden_states`) for a decode batch is captured once per size bucket when the worker starts (largest
bucket first, all sharing
one memory pool) and replayed: a step's inputs are copied into the graph's static buffers and the rows
past the batch are padded so that they write only the padding KV slot 0 and read one entry of row 0's
table (slot 0 too when that row is free: the table starts zeroed). The LM head runs after the replay,
eagerly: a graph's own [bucket, vocab] output would be kept per bucket, ~1 GB for a 150k vocabulary.
Everything else runs eagerly: prefill
and mixed steps, drafts to verify, prompt logprobs, and batches past the largest bucket.

What the captured forward may do: only device work whose shapes are fixed by the bucket. The Triton
attention backend launches its decode kernel over the bucket's rows and reads the lengths from the device;
the rotary table is grown to the context length before capture, so no step grows it inside a graph. A model
that takes LoRA adapters captures each target layer's LoRA product over a static buffer of the rows' slots
(-1: the base, padding rows included), written per step like the other inputs: a step mixing adapters
replays as a base step does (kernels/triton/lora.py reads each row's slot on the device).

`capture=False` runs the same padded static batch eagerly, on any device: the CPU tests drive it to check a
padded step against the eager one, and the GPU tests check the captured graphs against both.
"""

from __future__ import annotations

import bisect
import logging

import torch

from tandem.kernels.ops import Ops
from tandem.protocol.engine_config import EngineConfig
from tandem.worker.attention_backend import AttentionBackend, TritonBackend
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.layers.lora import lora_context
from tandem.worker.lora_step import rows_from

log = logging.getLogger(__name__)

# Small buckets one by one where the padding would be relatively large, then every 16 rows.
_SMALL = (1, 2, 4, 8)
# Larger decode batches run eagerly: their step is the math's, and each bucket costs a capture at start.
MAX_GRAPH_BATCH = 512


def graphs_apply(cfg: EngineConfig, ops: Ops, backend: AttentionBackend) -> bool:
    """Decode graphs where the ops capture them (CUDA) unless --enforce-eager: one rank (the all-reduce of
    tensor parallelism is not captured) and the Triton attention backend (the torch ones build their plan
    from host lists)."""
    return (
        ops.cuda_graphs
        and not cfg.enforce_eager
        and cfg.tp_size == 1
        and isinstance(backend, TritonBackend)
    )


def decode_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured for a worker running at most max_batch requests (the last covers it)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return sorted({b for b in _SMALL if b < max_batch} | set(range(16, max_batch, 16)) | {max_batch})


class DecodeGraphs:
    """Runs decode batches of up to `buckets[-1]` requests padded to their bucket, from CUDA graphs
    (capture=True, CUDA only) or eagerly (capture=False)."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, max_batch: int, max_context: int,
                 capture: bool = True) -> None:
        device = kv.req_to_token.device
        if capture and not kv.req_to_token.is_cuda:  # a caller's mistake (graphs_apply asks the ops)
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.kv, self.capture = model, kv, capture
        self.buckets = decode_buckets(max_batch)
        n = self.buckets[-1]
        i64 = {"dtype": torch.int64, "device": device}
        # ForwardBatch field -> the value its padding rows hold; _buf: field -> its static buffer
        self._pads = {
            "input_ids": 0,
            "positions": 0,
            "out_cache_loc": 0,
            "req_pool_indices": 0,
            "seq_lens": 1,
        }
        self._buf = {name: torch.full((n,), pad, **i64) for name, pad in self._pads.items()}
        self._ones = torch.ones(n, **i64)
        self._arange = torch.arange(n, **i64)
        self.num_runs = 0  # decode steps run through here (the tests check that they were)
        self._dirty = 0  # rows [0, _dirty) of the buffers may hold an earlier step's real values
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> graph, its hidden
        # LoRA adapters: the rows' device slots (-1: the base); None: the model takes none
        self.lora = lora_context(model)
        self.lora_slots = torch.full((n,), -1, **i64)
        for rotary in model.rotaries():
            rotary.reserve(max_context)  # never grown inside a captured forward
        if capture:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode batch (no image token) whose every request wants its one logit row, within the
        largest bucket."""
        b = batch.batch_size
        return (0 < b <= self.max_batch and batch.all_decode and batch.logits_indices.numel() == b
                and batch.image_rows is None and batch.rope_positions is None)  # images: not in the graph

    def bucket(self, b: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, b)]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's float32 logits [B, vocab], as model.forward(batch, kv) gives them."""
        if not self.can_run(batch):
            raise ValueError("not a decode batch this runner takes (see can_run)")
        b = batch.batch_size
        size = self.bucket(b)
        self.num_runs += 1
        for name, pad in self._pads.items():
            buf = self._buf[name]
            buf[:b].copy_(getattr(batch, name), non_blocking=True)
            if self._dirty > b:  # rows an earlier, larger batch left behind
                buf[b : min(self._dirty, size)].fill_(pad)
        if self._dirty <= size:  # else rows past the bucket keep old values, which its graph never reads
            self._dirty = b
        if self.lora is not None:  # the step's adapters (the model runner set them), else the base's -1
            rows = self.lora.groups
            self.lora_slots[:size].fill_(-1)
            if rows is not None:
                self.lora_slots[:b].copy_(rows.slot_of_row, non_blocking=True)
        if self.capture:
            graph, hidden = self._graphs[size]
            graph.replay()
        else:
            pad = size - b
            static = self._static_batch(
                size,
                seq_lens=list(batch.seq_lens_cpu) + [1] * pad,
                rows=list(batch.req_pool_indices_cpu) + [0] * pad,
            )
            with rows_from(self.lora, self.lora_slots[:size]):
                hidden = self.model.hidden_states(static, self.kv)
        return self.model.compute_logits(hidden[:b])

    def _static_batch(self, size: int, seq_lens: list[int], rows: list[int]) -> ForwardBatch:
        """The buffers' first `size` rows as a batch. The host lists matter only eagerly (and for the
        rotary table's size, reserved already): a captured graph keeps what capture saw."""
        buf = self._buf
        return ForwardBatch.build(
            input_ids=buf["input_ids"][:size],
            positions=buf["positions"][:size],
            out_cache_loc=buf["out_cache_loc"][:size],
            req_pool_indices=buf["req_pool_indices"][:size],
            seq_lens=buf["seq_lens"][:size],
            extend_lens=self._ones[:size],
            logits_indices=self._arange[:size],
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=[1] * size,
            req_pool_indices_cpu=rows,
        )

    def _capture_all(self) -> None:
        # The buffers hold padding only: capture reads row 0's table and writes slot 0, nothing live.
        pool = None
        side = torch.cuda.Stream()
        for size in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool's memory
            batch = self._static_batch(size, seq_lens=[1] * size, rows=[0] * size)
            # One eager run first, off the capture: Triton compiles its kernels, cuBLAS picks its plans.
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), rows_from(self.lora, self.lora_slots[:size]):
                self.model.hidden_states(batch, self.kv)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), rows_from(self.lora, self.lora_slots[:size]):
                hidden = self.model.hidden_states(batch, self.kv)
            pool = graph.pool()
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s", self.buckets)

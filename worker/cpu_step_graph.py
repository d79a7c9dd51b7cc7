"""Decode steps on CPU replayed from a recorded list of C kernel calls: the CPU twin of decode_graphs.py.

At batch 1 a small model's CPU decode step is mostly Python dispatch (some eleven ops a layer, each a call
with its checks) rather than the weights streaming through the quantized products. So once, at start, the
worker records the forward as nodes of kernels/csrc/step_graph.c: every op's C kernel with its arguments
bound to persistent buffers (token ids, positions, KV slots, request rows, lengths), the KV pools, the weights
and scratch, up to the logits when the LM head is a quantized product (else compute_logits runs after the
replay). A decode step writes its inputs into those buffers and replays the list with one call, which runs
the whole step in one parallel region of the worker's threads; sampling runs after it as in the eager path.
The row count is an argument of the replay, so one recording serves every decode batch up to `max_batch`
without padding rows.

The nodes are recorded from the model's own forward (worker/step_recorder.py): each op appends the node of
the C kernel its eager call runs, with the arguments it would get, so a replay gives the eager forward's bits
(tests hold them equal; K/V written to a float16 or bfloat16 pool are rounded as torch rounds them, to a
q8_0 pool quantized by the eager write's own C code), and a forward reaching an op with no node is not
recorded: its decode steps run eagerly (logged once, naming the op). It applies on CPU with the C kernels
built (a float32 model), the `cpu` attention backend and one rank, where every op of the forward has a
node: linear layers from GGUF blocks or from a float32 or bf16 weight the C kernel takes (for up to
DENSE_MAX_ROWS rows: a recording then serves batches up to that), MoE layers as one C call each
(kernels/native/moe.py). The LM head is a node when its product is one (else compute_logits runs after the
replay), then greedy sampling's argmax when the model does not transform its logits. --enforce-eager turns
it off.
"""

from __future__ import annotations

import logging

import torch

from tandem.kernels.native import quant_linear
from tandem.kernels.native import step_graph as sg
from tandem.kernels.native.paged_attention import KV_TYPES
from tandem.kernels.native.step_graph import Node
from tandem.protocol.engine_config import EngineConfig
from tandem.worker.attention_backend import CpuBackend
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tandem.worker.layers.linear import PackableLinear
from tandem.worker.layers.lora import lora_context
from tandem.worker.lora_step import rows_from
from tandem.worker.step_recorder import StepRecorder, Unrecordable

log = logging.getLogger(__name__)
_told: set[str] = set()  # refusals logged (once each)


def cpu_graph_applies(cfg: EngineConfig, model: torch.nn.Module, kv: KVCache) -> bool:
    """Whether CpuStepGraph records this model: the machine's conditions (see the module doc), then a
    recording of one row, which refuses at the first op of the forward that has no node."""
    backend = getattr(model, "attn_backend", None)
    if cfg.enforce_eager or cfg.tp_size != 1 or kv.device.type != "cpu" or kv.dtype not in KV_TYPES:
        return False
    if not isinstance(backend, CpuBackend) or not backend.native or not sg.available():
        return False
    try:
        CpuStepGraph(model, kv, max_batch=1, max_context=1)
    except Unrecordable as e:
        if str(e) not in _told:
            _told.add(str(e))
            log.info("CPU step graph not recorded: the forward reaches %s, which has no C node; decode steps "
                     "run eagerly", e)
        return False
    return True


def graph_batch(model: torch.nn.Module, max_batch: int) -> int:
    """The most decode rows a recording serves: a float weight's product runs in the C kernel (a node) only
    up to DENSE_MAX_ROWS rows (more go to torch in the eager path, whose bits the replay gives)."""
    dense = [m.dense for m in model.modules() if isinstance(m, PackableLinear) and m.dense is not None]
    dense += [m.head_dense for m in model.modules() if getattr(m, "head_dense", None) is not None]
    # and GGUF blocks only below the rows from which the eager product is the bf16 one (Ops.bf16_block_rows)
    bf16 = [m.ops.bf16_block_rows - 1 for m in model.modules() if isinstance(m, PackableLinear)
            and m.quant is not None and m.ops is not None and m.ops.bf16_block_rows is not None]
    return min([max_batch, *(quant_linear.DENSE_MAX_ROWS[w.qtype] for w in dense), *bf16])


class CpuStepGraph:
    """Runs decode batches of up to max_batch requests by replaying one recorded step."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, max_batch: int, max_context: int) -> None:
        """Records the step (raises Unrecordable where the forward has an op with no node)."""
        mb = graph_batch(model, max_batch)
        self.model, self.kv, self.max_batch = model, kv, mb
        self.num_runs = 0  # decode steps run through here (the tests check that they were)
        i64 = {"dtype": torch.int64}
        self.ids, self.positions, self.slots, self.rows, self.lens = (
            torch.zeros(mb, **i64) for _ in range(5)
        )
        self.swa_slots = torch.zeros(mb, **i64)  # the step's slots in the sliding layers' own pool
        # LoRA adapters: each row's device slot (-1: the base), written per replay; None: the model takes none
        self.lora = lora_context(model)
        self.lora_slots = torch.full((mb,), -1, **i64)
        self._inputs = {"input_ids": self.ids, "positions": self.positions, "out_cache_loc": self.slots,
                        "req_pool_indices": self.rows, "seq_lens": self.lens}
        for rotary in model.rotaries():
            rotary.reserve(max_context)  # the tables are never grown between recording and replay
        self.threads = max(1, torch.get_num_threads())  # the attention's scratch is per thread, for this many
        batch = ForwardBatch(**self._inputs, extend_lens=torch.ones(mb, **i64),
                             logits_indices=torch.arange(mb, **i64), seq_lens_cpu=[1] * mb,
                             extend_lens_cpu=[1] * mb, req_pool_indices_cpu=[0] * mb)
        rec = StepRecorder(kv, batch, self.swa_slots, max_context, self.threads)
        # [mb, vocab] when the LM head is a node; else compute_logits runs after the replay
        self.logits: torch.Tensor | None = None
        with rec.recording(model), rows_from(self.lora, self.lora_slots):  # LoRA nodes read these slots
            self.final = model.hidden_states(batch, kv)
            recorded = len(rec.nodes)
            try:
                self.logits = model.head_logits(self.final)
            except Unrecordable:
                del rec.nodes[recorded:]
        # [max_batch] int64: each row's argmax of the logits, the ARGMAX node's output (None: no such node)
        self.greedy: torch.Tensor | None = None
        # greedy sampling's tokens of these logits
        if self.logits is not None and not model.transforms_logits:
            self.greedy = rec.temp(mb, dtype=torch.int64)
            rec.nodes.append(Node(sg.ARGMAX, logits=self.logits, ld=self.logits.stride(0),
                                  vocab=self.logits.shape[1], out=self.greedy))
        outputs = [t for t in (self.final, self.logits, self.greedy) if t is not None]
        self.nodes, self._keep = rec.finish(outputs)
        log.info("CPU step graph: %d nodes for decode batches up to %d", len(self.nodes), mb)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode batch (no image token) whose every request wants its one logit row, within
        max_batch."""
        b = batch.batch_size
        return (0 < b <= self.max_batch and batch.all_decode and batch.logits_indices.numel() == b
                and batch.image_rows is None and batch.rope_positions is None)  # images: not in the graph

    def greedy_tokens(self, rows: int) -> torch.Tensor | None:
        """After run: the last replay's argmax of each row's logits (torch.argmax's answer; a copy), or None
        when the graph has no ARGMAX node (the LM head after the replay, or a model that transforms its
        logits, as Gemma's softcap does)."""
        return None if self.greedy is None else self.greedy[:rows].clone()

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's float32 logits [B, vocab], as model.forward(batch, kv) gives them."""
        if not self.can_run(batch):
            raise ValueError("not a decode batch this graph takes (see can_run)")
        b = batch.batch_size
        for name, buf in self._inputs.items():
            buf[:b].copy_(getattr(batch, name))
        if self.kv.swa_map is not None:
            torch.index_select(self.kv.swa_map, 0, batch.out_cache_loc, out=self.swa_slots[:b])
        if self.lora is not None:  # the step's adapters (the model runner set them), else the base's -1
            rows = self.lora.groups
            self.lora_slots[:b].copy_(rows.slot_of_row) if rows is not None else self.lora_slots[:b].fill_(-1)
        if batch.max_seq_len > self.model.rotary.cos.shape[0]:
            raise ValueError(f"position {batch.max_seq_len} past the recorded rotary table")
        sg.run(self.nodes, b, min(torch.get_num_threads(), self.threads))
        self.num_runs += 1
        if self.logits is not None:  # a view of the graph's buffer: the next replay writes over it
            return self.model.finish_logits(self.logits[:b])
        return self.model.compute_logits(self.final[:b])


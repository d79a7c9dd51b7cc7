"""The worker's step: free finished rows, add new requests, prepare inputs, forward, sample."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.kv_quant import Q8_0
from tandem.protocol import fault_injection
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode
from tandem.protocol.gguf_metadata import is_gguf
from tandem.protocol.gguf_tensor_index import FLOAT_GGUF_TYPES, gguf_linear_type
from tandem.protocol.messages import Logprobs, ModelRunnerOutput, SampleStep, SchedulerOutput
from tandem.protocol.model_info import ModelInfo
from tandem.worker.cpu_step_graph import CpuStepGraph, cpu_graph_applies
from tandem.worker.decode_graphs import MAX_GRAPH_BATCH, DecodeGraphs, graphs_apply
from tandem.worker.device import resolve_device, resolve_dtype, resolve_kv_dtype, resolve_weight_dtype
from tandem.worker.distributed import Dist, local_rank
from tandem.worker.encoder_cache import EncoderCache, model_stages
from tandem.worker.failed_step import FailedStep, RequestFault, describe
from tandem.worker.host_to_device import to_device
from tandem.worker.image_rows import attach_images, attach_rope_positions
from tandem.worker.input_prep import advance_state, plan_prompt_logprobs, prepare_inputs
from tandem.worker.kv_cache import KVCache
from tandem.worker.loader import load_model
from tandem.worker.logprobs import prompt_logprobs, sampled_logprobs
from tandem.worker.lora_step import WorkerAdapters
from tandem.worker.memory import host_pool_tokens, kv_pool_sizes
from tandem.worker.penalties import process_logits
from tandem.worker.pending_step import PendingStep, StepClock
from tandem.worker.pooling import plan_pooling, pool_hidden
from tandem.worker.request_state import RequestState
from tandem.worker.sampler import greedy_row, sample
from tandem.worker.spec_verify import (
    propose_drafts,
    record_drafts,
    sample_with_drafts,
    sampler_logit_rows,
    trim_drafts,
)


@dataclass
class _Deferred:
    """A step whose forward ran and whose sampling waits for the grammar bitmask."""

    so: SchedulerOutput
    step: PendingStep
    logits: torch.Tensor
    rows: list[int]
    t0: float
    start: torch.cuda.Event | None


class ModelRunner:
    def __init__(self, cfg: EngineConfig, info: ModelInfo, rank: int = 0, dist: Dist | None = None) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and cfg.tp_size > 1:
            self.device = torch.device("cuda", local_rank(cfg, rank))
        self.dtype = resolve_dtype(cfg.dtype, self.device)  # the activations'
        # the float linear weights' (bf16 under a float32 model with `auto` on CPUs with bf16 matmuls)
        gguf_weights = gguf_linear_type(cfg.model) if is_gguf(cfg.model) else None
        self.weight_dtype = resolve_weight_dtype(cfg.dtype, self.device, gguf_weights=gguf_weights)
        # The KV pools' (device and host) element; K/V are rounded (or quantized: q8_0, uint8 pools) to it
        # when written. Attention reads it as is (the C kernel widens half pools and dequantizes q8_0 blocks
        # to float32 as it loads; torch attends a mixed pair in float32).
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype, self.device)
        # Every kernel choice, made once: input prep, attention, the layers and speculation share it.
        int8 = cfg.cpu_int8_activations
        if int8 is None:  # by default a quantized file runs as llama.cpp runs it, where the C kernels can
            int8 = None if gguf_weights not in (None, *FLOAT_GGUF_TYPES) else False
        self.ops = resolve_ops(self.device, self.dtype, cfg.attention_backend, int8)
        if self.ops.attention == "triton" and self.kv_dtype not in (self.dtype, Q8_0):
            raise ValueError(f"--kv-cache-dtype {cfg.kv_cache_dtype} with a {self.dtype} model needs "
                             "--attention-backend torch (the triton kernel takes the model's dtype or q8_0)")
        self.model = load_model(
            cfg.model, dtype=self.dtype, device=self.device, tp_rank=rank, tp_size=cfg.tp_size, ops=self.ops,
            weight_dtype=self.weight_dtype,
        )
        self.model.pack_cpu_weights(self.weight_dtype)
        self.adapters = WorkerAdapters(self.model, cfg.max_loras, cfg.max_lora_rank, self.dtype,
                                       self.device) if cfg.lora else None
        mc = self.model.config
        max_reqs = cfg.max_running_requests
        self.max_context = info.max_model_len
        self.num_kv_slots, self.num_swa_slots = kv_pool_sizes(
            cfg, mc, self.kv_dtype, self.device, max_reqs * self.max_context
        )
        if dist is not None:  # every rank's pool must hold the slots the scheduler hands out
            self.num_kv_slots = dist.min_int(self.num_kv_slots)
            self.num_swa_slots = dist.min_int(self.num_swa_slots)
        self.num_host_slots = host_pool_tokens(cfg, mc, self.kv_dtype)  # the same on every rank
        # + a page: page 0 (slot 0 is the padding slot) is never handed out by the scheduler.
        self.kv = KVCache(
            mc.num_hidden_layers,
            self.num_kv_slots + cfg.page_size,
            mc.local_kv_heads(cfg.tp_size),  # only this rank's KV heads
            mc.head_dim,
            self.kv_dtype,
            self.device,
            max_reqs=max_reqs,
            max_context=self.max_context,
            host_slots=self.num_host_slots + cfg.page_size if self.num_host_slots else 0,
            swa_slots=self.num_swa_slots + cfg.page_size if self.num_swa_slots else 0,
            swa_layers=frozenset(i for i in range(mc.num_hidden_layers) if mc.is_sliding(i)),
        )
        self.state = RequestState(max_reqs, self.max_context, self.device)
        self.images = EncoderCache(model_stages(self.model)) if info.image_token_id is not None else None
        self.images_bidirectional = info.images_bidirectional
        self.mrope = hasattr(self.model, "mrope_section")  # multimodal RoPE (Qwen2.5-VL)
        self.graphs: DecodeGraphs | CpuStepGraph | None = None
        if graphs_apply(cfg, self.ops, self.model.attn_backend):
            # After the KV pool: capture takes its memory from what the pool left.
            self.graphs = DecodeGraphs(self.model, self.kv, min(max_reqs, MAX_GRAPH_BATCH), self.max_context)
        elif cpu_graph_applies(cfg, self.model, self.kv):
            self.graphs = CpuStepGraph(self.model, self.kv, min(max_reqs, MAX_GRAPH_BATCH), self.max_context)
        self.clock = StepClock(self.device)
        self._deferred: _Deferred | None = None
        self.max_reqs = max_reqs
        self._current: SchedulerOutput | None = None  # the step being run (for its rows if it fails)
        self._failed_step: int | None = None  # its SampleStep, if one comes, is dropped
        self.poisoned: set[int] = set()  # rows of failed steps, until the scheduler frees them

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to completion (tests and simple callers)."""
        return self.launch(so).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> PendingStep | None:
        """Queue one step; its sampled tokens are read with .result() (no host sync before that on CUDA,
        unless a row asked for logprobs, which are turned into lists here). A step with defer_sample
        stops after the forward and returns None: `sample_deferred` finishes it."""
        t0, start = self.clock.begin()
        self._current = so
        st = self.state
        for row in so.freed_req_pool_indices:
            st.free(row)
            self.poisoned.discard(row)
        for r in so.new_reqs:
            st.add(r)
        step = PendingStep(so.step_id, None)
        if so.kv_copies is not None:
            self.kv.copy(so.kv_copies)  # before the forward, which may write the slots they free
        self._check_faults(so)
        if self.adapters is not None and (so.lora_loads or so.lora_forget):
            self.adapters.apply(so.lora_loads, so.lora_forget)
        if self.images is not None and (so.encode or so.encode_drop):
            encoded = self.images.encoded
            self.images.drop(so.encode_drop)
            step.images_kept = self.images.run(so.encode) or None
            step.images_encoded = self.images.encoded - encoded
        if not so.scheduled:  # a step of image encoding only
            self.clock.finish(step, t0, start, after_idle=so.after_idle)
            self._current = None
            return step
        if self.cfg.spec_tokens:
            trimmed = trim_drafts(so, st, self.ops)
            if trimmed is not so:
                step.num_drafts = [s.num_drafts for s in trimmed.scheduled if s.sample]
                so = trimmed
        plp = plan_prompt_logprobs(so.scheduled, st)
        pool = plan_pooling(so.scheduled, st, self.cfg.pooling)
        batch = prepare_inputs(
            so.scheduled, st, self.kv, self.ops, plp, pool.hidden_indices if pool else None
        )
        if self.images is not None and st.images:
            encoded = self.images.encoded
            attach_images(batch, so.scheduled, st, self.images, self.images_bidirectional)
            step.images_encoded += self.images.encoded - encoded
            if self.mrope:
                attach_rope_positions(batch, st, self.model)
        if self.adapters is not None:
            self.adapters.set_step(so.scheduled, st, batch)
        greedy = None  # the CPU step graph's argmax of each row's logits, when it has that node
        if pool is not None:  # the pooled tokens' hidden states follow the rows that need logits
            h = self.model.hidden_states(batch, self.kv)
            k = h.shape[0] - len(pool.hidden_indices)
            step.embeddings = pool_hidden(pool, h[k:], st, self.cfg.pooling)
            logits = self.model.compute_logits(h[:k]) if k else h[:0].float()
        elif self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.run(batch)
            if isinstance(self.graphs, CpuStepGraph):
                greedy = self.graphs.greedy_tokens(batch.batch_size)
        else:
            logits = self.model.forward(batch, self.kv)
        rows = [s.req_pool_idx for s in so.scheduled if s.sample]
        if plp is not None:  # the prompt positions' logits follow the sampling rows' (and drafts')
            n = len(rows) + sum(s.num_drafts for s in so.scheduled)
            try:
                step.prompt_logprobs = prompt_logprobs(logits[n:], plp)
            except torch.OutOfMemoryError as e:  # a long chunk's [positions, vocab] log-softmax
                raise RequestFault(plp.rows, ErrorCode.OUT_OF_MEMORY, f"prompt logprobs: {e}") from e
            logits = logits[:n]
        if so.defer_sample:
            self._deferred = _Deferred(so, step, logits, rows, t0, start)
            self._current = None
            return None
        return self._finish(so, step, logits, rows, t0, start, greedy)

    def _check_faults(self, so: SchedulerOutput) -> None:
        poisoned = self.poisoned.intersection(s.req_pool_idx for s in so.scheduled)
        if poisoned:
            raise RequestFault(
                [], ErrorCode.FAILED_INTERNAL, f"skipped: rows {sorted(poisoned)} failed before"
            )
        for r in so.new_reqs:
            try:
                fault_injection.check("worker.step", r.token_ids[: r.num_prompt])
            except fault_injection.InjectedFault as e:
                raise RequestFault([r.req_pool_idx], ErrorCode.FAILED_INTERNAL, str(e)) from e

    @property
    def running_step(self) -> bool:
        return self._current is not None

    def fail(self, e: Exception) -> FailedStep:
        """The step being run raised: its rows are poisoned until freed, and its StepFailed is due."""
        so, self._current, self._deferred = self._current, None, None
        assert so is not None, "no step was running"
        self.poisoned.update(s.req_pool_idx for s in so.scheduled)
        self._failed_step = so.step_id
        return describe(so.step_id, e)

    @torch.inference_mode()
    def sample_deferred(self, msg: SampleStep) -> PendingStep | None:
        """Sample the step whose forward already ran, with the grammar bitmask applied to its rows.
        None: that step failed already (its StepFailed is on its way)."""
        d = self._deferred
        if d is None and msg.step_id == self._failed_step:
            return None
        if d is None or d.so.step_id != msg.step_id:
            raise RuntimeError(f"sample for step {msg.step_id} but no such step is waiting")
        self._deferred = None
        self._current = d.so
        if msg.mask_rows:
            words = torch.frombuffer(bytearray(msg.bitmask), dtype=torch.int32).view(len(msg.mask_rows), -1)
            rows = msg.mask_rows
            if any(s.num_drafts for s in d.so.scheduled):  # drafts' rows sit between the samplers' rows
                first = sampler_logit_rows(d.so.scheduled)
                rows = [first[i] for i in rows]
            dev = d.logits.device
            self.ops.apply_bitmask(d.logits, words.to(dev, non_blocking=True), rows=to_device([rows], dev)[0])
        return self._finish(d.so, d.step, d.logits, d.rows, d.t0, d.start)

    def _finish(
        self, so: SchedulerOutput, step: PendingStep, logits: torch.Tensor, rows: list[int], t0: float,
        start: torch.cuda.Event | None, greedy: torch.Tensor | None = None,
    ) -> PendingStep:
        tokens = None
        if any(s.num_drafts for s in so.scheduled):
            tokens, step.num_sampled, step.logprobs = sample_with_drafts(
                logits, so.scheduled, self.state, self._sample
            )
        elif rows:
            tokens, step.logprobs = self._sample(logits, rows, greedy)
        ops = self.ops
        advance_state(so.scheduled, self.state, ops, tokens if tokens is not None else [], step.num_sampled)
        if self.cfg.spec_tokens:  # the next step's drafts, from this step's real tokens, on the device
            cfg = self.cfg
            record_drafts(so.scheduled, step.num_sampled, self.state, ops)
            propose_drafts(
                so.scheduled, self.state, ops, cfg.spec_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )
        if tokens is not None:
            # Pinned + non_blocking: on CUDA the copy is queued behind the step, not waited for.
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=self.device.type == "cuda")
            step.tokens = host.copy_(tokens, non_blocking=True)
        self.clock.finish(step, t0, start, after_idle=so.after_idle)
        self._current = None
        return step

    def _sample(
        self, logits: torch.Tensor, rows: list[int], greedy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[Logprobs | None] | None]:
        """logits [len(rows), V] of the sampling rows (modified in place) -> tokens, and their logprobs
        aligned with them when any row asked. greedy: the argmax of these very logits (the CPU step graph's
        node), taken when every row is greedy and nothing changes the logits first."""
        st = self.state
        lp_sel = [j for j, r in enumerate(rows) if r in st.logprob_rows] if st.logprob_rows else []
        rows_t, lp_sel_t = to_device([rows, lp_sel], logits.device)
        # Logprobs are of the raw logits: take a copy before the penalties write into them.
        raw = logits[lp_sel_t] if lp_sel else None
        if st.penalty_rows or st.min_tokens_rows:
            process_logits(logits, rows, st)
        if (
            greedy is not None
            and greedy.shape[0] == len(rows)
            and not (st.penalty_rows or st.min_tokens_rows)
            and all(greedy_row(st.temperature[r], st.top_k[r]) for r in rows)
        ):
            tokens = greedy
        else:
            tokens = sample(
                logits,
                [st.temperature[r] for r in rows],
                [st.top_k[r] for r in rows],
                [st.top_p[r] for r in rows],
                [st.min_p[r] for r in rows],
                [st.seeded_generator(r) for r in rows],
                st.device_params(rows_t),
            )
        if raw is None:
            return tokens, None
        lps: list[Logprobs | None] = [None] * len(rows)
        sel_tokens = tokens[lp_sel_t]
        for j, lp in zip(lp_sel, sampled_logprobs(raw, sel_tokens, [st.logprobs[rows[j]] for j in lp_sel])):
            lps[j] = lp
        return tokens, lps

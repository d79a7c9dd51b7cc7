"""The worker's step: free finished rows, add new requests, prepare inputs, forward, sample."""
from __future__ import annotations

import time

import torch

from protocol.engine_config import EngineConfig
from protocol.messages import ModelRunnerOutput, SchedulerOutput
from protocol.model_info import ModelInfo
from worker.device import resolve_device, resolve_dtype
from worker.input_prep import advance_state, prepare_inputs
from worker.kv_cache import KVCache
from worker.loader import load_model
from worker.memory import kv_pool_tokens
from worker.request_state import RequestState
from worker.sampler import sample


class ModelRunner:
    def __init__(self, cfg: EngineConfig, info: ModelInfo) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model = load_model(cfg.model, dtype=self.dtype, device=self.device)
        mc = self.model.config
        max_reqs = cfg.max_running_requests
        self.max_context = info.max_model_len
        self.num_kv_slots = kv_pool_tokens(cfg, mc, self.dtype, self.device, max_reqs * self.max_context)
        # + a page: page 0 (slot 0 is the padding slot) is never handed out by the scheduler.
        self.kv = KVCache(
            mc.num_hidden_layers,
            self.num_kv_slots + cfg.page_size,
            mc.num_key_value_heads,
            mc.head_dim,
            self.dtype,
            self.device,
            max_reqs=max_reqs,
            max_context=self.max_context,
        )
        self.state = RequestState(max_reqs, self.max_context, self.device)
        self.max_reqs = max_reqs

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        for row in so.finished_req_idxs:
            self.state.free(row)
        for r in so.new_reqs:
            self.state.add(r)
        batch = prepare_inputs(so.scheduled, self.state, self.kv)
        logits = self.model.forward(batch, self.kv)
        sampled: list[int] = []
        if logits.shape[0]:
            rows = [s.req_idx for s in so.scheduled if s.sample]
            st = self.state
            idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
            gens = [st.seeded_generator(r) for r in rows]
            tokens = sample(logits, st.temperature[idx], st.top_k[idx], st.top_p[idx], st.min_p[idx], gens)
            sampled = tokens.tolist()
        advance_state(so.scheduled, self.state, sampled)
        return ModelRunnerOutput(so.step_id, sampled, busy_s=time.perf_counter() - t0)

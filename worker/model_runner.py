"""The worker's step: free finished rows, add new requests, prepare inputs, forward, sample."""
from __future__ import annotations

import time

import torch

from protocol.engine_config import EngineConfig
from protocol.messages import Logprobs, ModelRunnerOutput, SchedulerOutput
from protocol.model_info import ModelInfo
from worker.device import resolve_device, resolve_dtype
from worker.input_prep import advance_state, plan_prompt_logprobs, prepare_inputs
from worker.kv_cache import KVCache
from worker.loader import load_model
from worker.logprobs import prompt_logprobs, sampled_logprobs
from worker.memory import kv_pool_tokens
from worker.penalties import process_logits
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
        st = self.state
        for row in so.finished_req_idxs:
            st.free(row)
        for r in so.new_reqs:
            st.add(r)
        plp = plan_prompt_logprobs(so.scheduled, st)
        batch = prepare_inputs(so.scheduled, st, self.kv, plp)
        logits = self.model.forward(batch, self.kv)
        rows = [s.req_idx for s in so.scheduled if s.sample]
        plps = None
        if plp is not None:  # the prompt positions' logits follow the sampling rows'
            plps = prompt_logprobs(logits[len(rows) :], plp)
            logits = logits[: len(rows)]
        sampled: list[int] = []
        lps = None
        if rows:
            sampled, lps = self._sample(logits, rows)
        advance_state(so.scheduled, st, sampled)
        return ModelRunnerOutput(
            so.step_id, sampled, logprobs=lps, prompt_logprobs=plps, busy_s=time.perf_counter() - t0
        )

    def _sample(
        self, logits: torch.Tensor, rows: list[int]
    ) -> tuple[list[int], list[Logprobs | None] | None]:
        """logits [len(rows), V] of the sampling rows (modified in place) -> tokens, and their logprobs
        aligned with them when any row asked."""
        st = self.state
        dev = logits.device
        lp_sel = [j for j, r in enumerate(rows) if r in st.logprob_rows] if st.logprob_rows else []
        # Logprobs are of the raw logits: take a copy before the penalties write into them.
        raw = logits[torch.tensor(lp_sel, device=dev)] if lp_sel else None
        if st.penalty_rows or st.min_tokens_rows:
            process_logits(logits, rows, st)
        idx = torch.tensor(rows, dtype=torch.int64, device=dev)
        gens = [st.seeded_generator(r) for r in rows]
        tokens = sample(logits, st.temperature[idx], st.top_k[idx], st.top_p[idx], st.min_p[idx], gens)
        sampled = tokens.tolist()
        if raw is None:
            return sampled, None
        lps: list[Logprobs | None] = [None] * len(rows)
        sel_tokens = tokens[torch.tensor(lp_sel, device=dev)]
        for j, lp in zip(lp_sel, sampled_logprobs(raw, sel_tokens, [st.logprobs[rows[j]] for j in lp_sel])):
            lps[j] = lp
        return sampled, lps

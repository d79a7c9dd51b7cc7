"""The scheduler's state machine, free of sockets: requests in, steps out, results committed in order.

`schedule()` may be called again before the previous step's result is back (the async pipeline):
counters move optimistically, and `commit()` applies results in step order.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import msgspec

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.messages import (
    DetokRegister,
    EngineLoad,
    ModelRunnerOutput,
    RequestError,
    SampleStep,
    SchedulerOutput,
    StepFailed,
    TokenizedRequest,
)
from tandem.protocol.model_info import ModelInfo
from tandem.scheduler.decode import schedule_running
from tandem.scheduler.delta_assembly import DeltaAssembly
from tandem.scheduler.embedding import EmbeddingOutbox, take_embeddings
from tandem.scheduler.finish import FinishReason
from tandem.scheduler.image_encoding import ImageEncoding
from tandem.scheduler.kv_cache import KVCacheManager
from tandem.scheduler.lora_adapters import LoraAdapters, lora_of
from tandem.scheduler.lora_calls import settle_loras
from tandem.scheduler.prefill import admit_waiting
from tandem.scheduler.prompt_logprobs import new_prompt_logprobs
from tandem.scheduler.req import Req
from tandem.scheduler.request_checks import refusal
from tandem.scheduler.scheduling_policy import make_policy
from tandem.scheduler.sessions import SessionError, SessionStore
from tandem.scheduler.spec_decode import SpecStats, Speculation
from tandem.scheduler.step_plan import InflightStep, StepPlan, to_output
from tandem.scheduler.stop_checker import StopChecker
from tandem.scheduler.structured import StructuredOutput
from tandem.scheduler.token_acceptance import accept_token


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens computed for prompts (and re-prefills)
    decode_tokens: int = 0
    retractions: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache at first admission
    prefix_hits: int = 0


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        info: ModelInfo,
        num_kv_slots: int,
        num_host_slots: int | None = None,
        num_swa_slots: int = 0,
    ) -> None:
        """num_host_slots, num_swa_slots: the worker's host tier (default cfg.host_kv_tokens) and sliding
        pool."""
        self.cfg, self.info = cfg, info
        self.kv = KVCacheManager(
            num_kv_slots, cfg.max_running_requests, info.max_model_len, cfg.page_size, cfg.prefix_cache,
            cfg.host_kv_tokens if num_host_slots is None else num_host_slots, cfg.host_kv_policy,
            info.sliding_window, num_swa_slots,
        )
        self.eos = frozenset(info.eos_token_ids)
        self.waiting = make_policy(cfg.scheduling_policy)  # the waiting queue, in the policy's order
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.inflight: deque[InflightStep] = deque()
        self.freed_rows: list[int] = []  # rows the worker must drop at the next step
        self.outbox: list[msgspec.Struct] = []  # for the detokenizer, in order
        self.deltas = DeltaAssembly()  # this commit's, to the detokenizer
        self._embedded = EmbeddingOutbox()
        self.stats = SchedulerStats()
        self.spec = SpecStats()  # reported in the load either way; moves only with speculation on
        self.speculation = Speculation(cfg.spec_tokens, self.kv, self.spec) if cfg.spec_tokens else None
        self.stop_checker = StopChecker(cfg.model)
        self.structured = StructuredOutput(cfg.model, info.vocab_size, cfg.grammar_compile_timeout_s)
        self.sessions = SessionStore.for_engine(self.kv, cfg.session_kv_tokens, cfg.prefix_cache)
        self._next_step = 0
        self._arrivals = 0
        self.encoding = None if info.image_token_id is None else ImageEncoding(
            info.image_encoder_pieces, info.image_pieces_per_layer, cfg.encoder_tokens_per_step)
        self.lora = LoraAdapters.for_engine(cfg)  # None: the engine serves no adapters

    # ---- requests in ------------------------------------------------------------------------
    def add_request(self, msg: TokenizedRequest) -> None:
        link, ids = None, msg.input_ids
        if msg.session is not None:  # its prompt continues a session's turn
            try:
                link, ids = self.sessions.resolve(
                    msg.session, ids, msg.params.max_tokens, self.info.max_model_len
                )
            except SessionError as e:
                self.outbox.append(RequestError(msg.rid, e.code, e.message))
                return
        images = msg.images
        if link is not None and link[1] is not None:  # the turn's images, then the new prompt's after it
            before = len(link[1].tokens)
            images = link[1].images + [msgspec.structs.replace(im, offset=im.offset + before)
                                       for im in images]
        room = self.info.max_model_len - len(ids)
        refused = refusal(msg, ids, room, self.kv.allocator.size, self.cfg.max_waiting_requests,
                          len(self.waiting) + len(self.structured.compiling), link[1] if link else None)
        if refused is not None:
            self.outbox.append(refused)
            return
        try:
            lora = None if msg.lora is None else lora_of(self.lora, msg.lora)
        except InvalidRequestError as e:
            return self.outbox.append(RequestError(msg.rid, e.code, e.message))
        max_new = 0 if msg.embed else min(msg.params.max_tokens or room, room)
        req = Req(msg.rid, ids, msg.params, self.eos, max_new, self._arrivals, msg.priority, embed=msg.embed,
                  images=images, images_bidirectional=self.info.images_bidirectional, lora=lora)
        req.pools_whole_prompt = msg.embed is not None and self.cfg.pooling != "last"
        self._arrivals += 1
        if link is not None:
            self.sessions.begin(req, link)
        self.reqs[req.rid] = req
        if not msg.embed and self.structured.wants_grammar(msg.params):
            self.structured.submit(req)  # waits compiling, off the queue: others go on meanwhile
        else:
            self.waiting.add(req)
        if not msg.embed:  # an embedding has no text: the detokenizer never hears of it
            p = msg.params
            self.outbox.append(DetokRegister(req.rid, ids[-8:], p.skip_special_tokens, p.stop))

    def abort(self, rid: str, message: str = "aborted by client") -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished():
            return  # already ended: an abort racing a finish is not an error
        req.to_finish = FinishReason.abort(message)
        if req.num_inflight_steps == 0:
            req.check_finished()
            self._finalize(req)
            self._flush_deltas()

    # ---- steps out ----------------------------------------------------------------------------
    def admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the queue; a grammar that failed (or timed out)
        ends its request."""
        ready, failed = self.structured.poll()
        for req in ready:
            if not req.finished():
                self.waiting.add(req)
        for req, code, message in failed:
            self.fail(req, code, message)

    def build_sample(self, step: InflightStep) -> SampleStep:
        """The bitmask of a deferred step; every step before it has been committed. A request whose
        matcher raises fails alone (its row goes unmasked; the token is dropped)."""
        step.sample_sent = True
        sample, failed = self.structured.sample_step(step)
        for req, message in failed:
            self.fail(req, ErrorCode.GRAMMAR_FAILED, message)
        self._flush_deltas()
        return sample

    def schedule(self) -> SchedulerOutput | None:
        budget, chunk = self.cfg.max_num_batched_tokens, self.cfg.chunked_prefill_tokens
        enc = self.encoding
        plan = StepPlan(budget=budget, prefill_cap=chunk or budget, swa_of=self.kv.swa_slots,
                        image_ready=enc.ready if enc else None, lora=self.lora)
        schedule_running(self.running, self.waiting, self.kv, plan, self._retract, self.speculation)
        admit_waiting(self.waiting, self.running, self.kv, plan, self.cfg.max_running_requests)
        if enc is not None and (plan.items or not self.inflight):  # a step of encoding only is never queued
            plan.encode = enc.plan(self.running, self.waiting, self.cfg.max_running_requests)
        self._note_first_scheduled(plan.reqs)
        if not (plan.items or plan.encode):
            self._fail_unschedulable()
            return None
        self.stats.prefill_tokens += plan.prefill_used
        self.stats.decode_tokens += sum(it.num_tokens for it in plan.items) - plan.prefill_used
        out, record = to_output(self._next_step, self.freed_rows, plan)
        out.kv_copies = self.kv.take_copies()  # host tier traffic of this step's evictions and loads
        out.encode_drop = enc.take_drops() if enc else []
        if self.lora is not None:
            out.lora_loads, out.lora_forget = self.lora.take_orders()
        self.freed_rows = []
        self._next_step += 1
        self.stats.steps += 1
        self.inflight.append(record)
        return out

    # ---- results in ----------------------------------------------------------------------------
    def commit(self, result: ModelRunnerOutput) -> None:
        """A step's result, in order: its KV becomes fact, its side outputs go out, each sampling request
        takes its tokens, the requests that run on hand on what they computed, and the deltas leave."""
        step = self.inflight.popleft()
        if step.step_id != result.step_id:
            raise RuntimeError(f"result for step {result.step_id} while step {step.step_id} was expected")
        for req, epoch, n in zip(step.reqs, step.epochs, step.num_tokens):
            if epoch == req.epoch and not req.finished():
                req.num_inflight_steps -= 1
                req.kv_committed_len += n
        if result.prompt_logprobs:
            for req, lp in new_prompt_logprobs(step, result.prompt_logprobs):
                self.deltas.of(req.rid).prompt_logprobs = lp
        if result.embeddings:
            take_embeddings(step, result.embeddings)
        if result.images_kept and self.encoding:
            self.encoding.kept(result.images_kept)
        self._take_sampled(step, result)
        self._run_on(step)
        if self.lora is not None and self.lora.unloading:  # an unload waiting for its adapter's requests
            settle_loras(self)
        self._flush_deltas()
        if self.cfg.debug_integrity:
            self.check_integrity()
        elif not (self.inflight or self.has_work):
            # the engine goes idle: both tiers' accounting must add up
            self.kv.check_idle(self.sessions.holds())

    def _take_sampled(self, step: InflightStep, result: ModelRunnerOutput) -> None:
        """Each sampling request's tokens: its drafts' verdict, then each token through its stops and
        grammar, up to the first that ends it."""
        counts = result.num_sampled or [1] * len(step.samplers)
        logprobs = result.logprobs or [None] * len(step.samplers)
        verified = result.num_drafts or [step.num_drafts[i] for i in step.samplers]
        pos = 0
        for i, count, lp, checked in zip(step.samplers, counts, logprobs, verified):
            tokens = result.sampled[pos : pos + count]
            pos += count
            req = step.reqs[i]
            if req.finished() or step.epochs[i] != req.epoch:
                continue  # the overrun of a request that already ended (or was retracted): dropped
            drafts = step.num_drafts[i]
            req.num_output_placeholders -= 1 + drafts
            if self.speculation is not None:
                self.speculation.commit(req, drafts, checked, len(tokens) - 1)
            for tok in tokens:  # an accepted run ends at the first token that finishes the request
                matched, grammar_done = None, False
                if req.to_finish is None:
                    try:
                        matched, grammar_done = accept_token(req, tok, lp, self.deltas, self.stop_checker)
                    except Exception as e:  # one request's fault (grammar, tokenizer) fails it alone
                        req.to_finish = FinishReason.error(
                            f"{type(e).__name__}: {e}", ErrorCode.FAILED_INTERNAL
                        )
                req.check_finished(matched, grammar_done)
                if req.finished():
                    # The accepted tokens after the end are dropped, and so is their KV.
                    req.kv_committed_len = min(req.kv_committed_len, len(req.fill_ids))
                    self._finalize(req)
                    break

    def _run_on(self, step: InflightStep) -> None:
        """The step's requests still running: one to finish ends once nothing of it is in flight; the others
        give back the sliding KV their windows passed and offer a prefill chunk to the cache (after the
        rejected drafts' rollback)."""
        for req, epoch, prefilling in zip(step.reqs, step.epochs, step.prefills):
            if epoch != req.epoch or req.finished():
                continue
            if req.to_finish is not None and req.num_inflight_steps == 0:
                req.check_finished()
                self._finalize(req)
            else:
                self.kv.after_commit(req, prefill=prefilling)

    def fail_step(self, msg: StepFailed) -> None:
        """A step raised on the worker and produced nothing. The requests to blame fail (all of the step
        when none is named); every other request of the steps in flight is retracted, since its KV and
        worker state are suspect, and recomputes the same tokens."""
        step = self.inflight.popleft()
        if step.step_id != msg.step_id:
            raise RuntimeError(f"failure of step {msg.step_id} while step {step.step_id} was expected")
        blamed = set(msg.req_pool_indices)
        for req, epoch in zip(step.reqs, step.epochs):
            if epoch == req.epoch and not req.finished() and (not blamed or req.req_pool_idx in blamed):
                self.fail(req, msg.code, msg.message)
        for s in (step, *self.inflight):
            for req, epoch in zip(s.reqs, s.epochs):
                if epoch != req.epoch or req.finished():
                    continue
                if req.to_finish is not None:
                    req.check_finished()
                    self._finalize(req)
                else:
                    self._retract(req)
        self._flush_deltas()
        if self.cfg.debug_integrity:
            self.check_integrity()

    # ---- internals ------------------------------------------------------------------------------
    def fail(self, req: Req, code: str, message: str) -> None:
        """End req with an error: now if nothing of it is in flight, else when its step is committed."""
        if req.finished() or req.to_finish is not None:
            return
        req.to_finish = FinishReason.error(message, code)
        if req.num_inflight_steps == 0:
            req.check_finished()
            self._finalize(req)

    def _finalize(self, req: Req) -> None:
        """The one end of every request: release its memory, tell the worker and the client."""
        reason = req.finished_reason
        assert reason is not None
        worker_knows = not req.needs_new_data
        computed = req.kv_committed_len
        row = self.kv.release(req)
        # a turn of it when it ended well: its session locks the KV just cached
        if req.session_id is not None:
            self.sessions.end(req, reason.kind in ("stop", "length"), computed)
        if row is not None and worker_knows:
            self.freed_rows.append(row)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif self.structured.compiling:
            self.structured.cancel(req.rid)
        del self.reqs[req.rid]
        req.time_stats.finished = time.time()
        if reason.kind == "error":
            self.stats.failed += 1
            self._flush_deltas()
            self.outbox.append(RequestError(req.rid, reason.code, reason.message))
            return
        self.stats.finished += 1
        self.stats.aborted += reason.kind == "abort"
        if req.embed is not None:
            return self._embedded.add(req)  # its one answer, sent with the commit's other embeddings
        self.deltas.finish(req)

    def _note_first_scheduled(self, reqs: list[Req]) -> None:
        now = time.time()
        for req in reqs:
            if not req.time_stats.first_scheduled:
                req.time_stats.first_scheduled = now
                req.cached_tokens = req.cache_protected_len  # admitted this step: all of it on the device
                self.stats.prefix_queries += len(req.origin_input_ids)
                self.stats.prefix_hits += req.cached_tokens

    @property
    def load(self) -> EngineLoad:
        return EngineLoad(
            len(self.running), len(self.reqs) - len(self.running),  # waiting includes grammars compiling
            1.0 - self.kv.available_slots / self.kv.allocator.size,
            self.stats.prefix_queries, self.stats.prefix_hits, self.stats.retractions, self.spec.num_drafts,
            self.spec.draft_tokens, self.spec.accepted_tokens, list(self.spec.accepted_at),
        )

    def _flush_deltas(self) -> None:
        if self.deltas:
            self.outbox.append(self.deltas.take(self.load))
        if self._embedded.pending:
            self.outbox.append(self._embedded.take(self.load))

    def _retract(self, req: Req) -> None:
        row = self.kv.release(req)
        if row is not None and not req.needs_new_data:
            self.freed_rows.append(row)
        req.reset_for_retract()
        self.running.remove(req)
        self.waiting.requeue(req)
        self.stats.retractions += 1

    def _fail_unschedulable(self) -> None:
        """Nothing could be scheduled and nothing is in flight: a request that cannot fit even alone."""
        if self.inflight or not (self.running or self.waiting):
            return
        victim = self.running[0] if self.running else next(iter(self.waiting))
        if len(self.running) > 1:
            return  # retraction will make room on the next call
        why = f"request needs more KV than the pool of {self.kv.allocator.size} slots holds"
        self.fail(victim, ErrorCode.KV_CAPACITY, why)

    def take_outbox(self) -> list[msgspec.Struct]:
        out, self.outbox = self.outbox, []
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def check_integrity(self) -> None:
        live = list(self.running) + list(self.waiting)
        self.kv.check_integrity(live, self.sessions.holds())
        for r in self.waiting:
            if r.req_pool_idx is not None:
                raise AssertionError(f"waiting {r.rid} holds a row")

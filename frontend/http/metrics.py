"""Prometheus metrics under vLLM's names with a `tandem:` prefix.

Engine gauges and totals (running, waiting, KV use, prefix cache, preemptions, speculative decoding's
drafts and acceptance, also per draft position) come from the EngineLoad that rides with every output;
per-request figures from each request's final output (TimeStats).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.frontend.completion import CompletionDelta
from tandem.protocol.final_info import HasFinal
from tandem.protocol.messages import EngineLoad

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tandem:{name}", doc, lab, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tandem:{name}", doc, lab, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tandem:{name}", doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "fraction of KV slots in use (1 = full)")
        self.prefix_queries = counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.preemptions = counter("num_preemptions", "requests retracted to free KV")
        self.spec_drafts = counter("spec_decode_num_drafts", "verify steps of a request with draft tokens")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "draft tokens verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "draft tokens accepted")
        self.spec_accepted_per_pos = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos", "draft tokens accepted at each draft position",
            lab + ["position"], registry=r,
        )
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "generated tokens of finished requests")
        self.success = Counter("tandem:request_success", "finished requests", lab + ["finished_reason"],
                               registry=r)
        self.model_name = model_name
        self.ttft = hist("time_to_first_token_seconds", "arrival to first token", _LATENCY)
        self.itl = hist(
            "inter_token_latency_seconds", "time between output tokens as the server sees them", _ITL
        )
        self.e2e = hist("e2e_request_latency_seconds", "arrival to finish", _LATENCY)
        self.queue = hist("request_queue_time_seconds", "arrival to first scheduled", _LATENCY)
        self._seen = EngineLoad()  # engine totals already counted

    def on_load(self, load: EngineLoad) -> None:
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.kv_usage.set(load.kv_usage)
        # The engine sends totals; count what is new since the last output (a restarted engine starts over).
        seen = self._seen
        pairs = [(self.prefix_queries, load.prefix_queries, seen.prefix_queries),
                 (self.prefix_hits, load.prefix_hits, seen.prefix_hits),
                 (self.preemptions, load.preemptions, seen.preemptions),
                 (self.spec_drafts, load.spec_num_drafts, seen.spec_num_drafts),
                 (self.spec_draft_tokens, load.spec_draft_tokens, seen.spec_draft_tokens),
                 (self.spec_accepted, load.spec_accepted_tokens, seen.spec_accepted_tokens)]
        for pos, now in enumerate(load.spec_accepted_per_position):
            before = seen.spec_accepted_per_position[pos] if pos < len(seen.spec_accepted_per_position) else 0
            pairs.append((self.spec_accepted_per_pos.labels(self.model_name, str(pos)), now, before))
        for counter, now, was in pairs:
            counter.inc(max(0, now - was))
        self._seen = load

    def on_delta(self, d: CompletionDelta, last_token_at: float | None) -> float | None:
        """Account one streamed delta; returns when its last token arrived (for the next gap)."""
        if d.load is not None:
            self.on_load(d.load)
        now = time.monotonic()
        if d.token_ids and last_token_at is not None:
            gap = (now - last_token_at) / len(d.token_ids)
            for _ in d.token_ids:
                self.itl.observe(gap)
        self.on_final(d)
        return now if d.token_ids else last_token_at

    def on_final(self, d: HasFinal, load: EngineLoad | None = None) -> None:
        """A request's end (a generation's last delta, an embedding's one answer); nothing before it."""
        if load is not None:
            self.on_load(load)
        if not d.finished:
            return
        self.success.labels(self.model_name, d.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(d.prompt_tokens)
        self.generation_tokens.inc(d.completion_tokens)
        if d.metrics is not None:
            m = d.metrics
            if m.first_token:
                self.ttft.observe(m.ttft_s)
            if m.first_scheduled:
                self.queue.observe(m.queue_s)
            self.e2e.observe(m.e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

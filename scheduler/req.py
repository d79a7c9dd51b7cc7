"""`Req`: one request as the scheduler sees it, a state machine with counters (docs/architecture.md §3).

Derived values are properties, never stored twice.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tandem.protocol.embed_params import EmbedParams
from tandem.protocol.image_item import ImageItem, key_token
from tandem.protocol.lora import lora_key
from tandem.protocol.sampling_params import SamplingParams
from tandem.protocol.time_stats import TimeStats
from tandem.scheduler.finish import FinishReason
from tandem.scheduler.prefix_cache import PrefixHandle
from tandem.scheduler.stop_checker import StopMatch


class KVPopError(RuntimeError):
    """A KV range was handed over twice: always a bug."""


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_new_tokens: int,
        arrival: int = 0,
        priority: int = 0,
        embed: EmbedParams | None = None,
        images: list[ImageItem] | None = None,
        images_bidirectional: bool = False,
        lora: tuple[str, int] | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        # The prompt's images (their pixels go to the worker with the request) and, for the prefix cache,
        # the prompt with each image's tokens replaced by its digest's key: the same image finds its KV,
        # another image with the same placeholder tokens does not.
        self.images = images or []
        self.images_bidirectional = images_bidirectional
        self.origin_key_ids = input_ids
        if self.images:
            self.origin_key_ids = list(input_ids)
            for im in self.images:
                self.origin_key_ids[im.offset : im.offset + im.length] = [key_token(im.digest)] * im.length
        # Under a LoRA adapter (its name, and its load's generation) the first token's key names the
        # adapter: its KV is never another's, nor a reload's. Its device slot is given at each admission.
        self.lora = None if lora is None else lora[0]
        self.lora_slot = -1
        if lora is not None:
            self.origin_key_ids = list(self.origin_key_ids)
            self.origin_key_ids[0] = lora_key(*lora, self.origin_key_ids[0])
        self.output_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_new_tokens = max_new_tokens
        self.arrival = arrival
        self.priority = priority  # lower is served first (--scheduling-policy priority)
        self.time_stats = TimeStats(arrival=time.time())
        self.cached_tokens = 0  # prompt tokens the prefix cache held at its first admission
        # Where its prefix came from at its latest admission: "none", "device" (a radix match on the
        # device), "host" (the match reached the host tier, loaded back) or "session" (a session turn's KV).
        self.prefix_source = "none"
        self.session_id: str | None = None  # the session it belongs to (scheduler/sessions.py)
        self.session_turn: Any = None  # the session's Turn it continues (None: none)

        # Memory: the request's row in the ReqToTokenPool and the KV it owns there.
        self.req_pool_idx: int | None = None
        self.prefix: PrefixHandle | None = None  # its cached prefix, locked in the cache while it has a row
        self.kv_committed_len = 0  # KV that is fact: computed by a finished step
        self.kv_allocated_len = 0  # KV handed out, >= committed (in-flight tokens)
        # Sliding-window layers with a pool of their own: row positions below this had their sliding KV given
        # back (every window has moved past them); the full slots stay. Page-aligned; 0 otherwise.
        self.swa_released_len = 0
        self._popped_committed = False
        self._popped_overallocated = False

        # Token accounting: the scheduler moves these before results are known.
        self.num_computed_tokens = 0  # optimistic: includes tokens of steps still in flight
        self.num_output_placeholders = 0  # sampled tokens in flight, not yet committed
        self.num_inflight_steps = 0
        self.needs_new_data = True  # the worker hasn't seen this request (or re-seen it after a retraction)
        self.epoch = 0  # bumped by each retraction, so results of steps from before it are dropped

        # Prompt logprobs: positions delivered to the client, and seen since the last retraction.
        self.prompt_lp_delivered = 0
        self.prompt_lp_seen_this_epoch = 0

        self.spec_accepted_tokens = 0  # draft tokens accepted (speculative decoding)

        self.grammar: Any = None  # a RequestGrammar (structured output) once compiled

        # An embedding request: its prompt is prefilled and pooled by the worker, nothing is sampled.
        self.embed = embed
        self.embedding = b""  # the pooled vector, once its last prefill step is committed
        # Every prompt token's hidden state is pooled (mean, cls): a prefix-cache hit would skip some.
        self.pools_whole_prompt = False

        self.to_finish: FinishReason | None = None
        self.finished_reason: FinishReason | None = None

    # ---- views -------------------------------------------------------------------------------
    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def key_ids(self) -> list[int]:
        """fill_ids as the prefix cache keys them (images by their digests)."""
        return self.origin_key_ids + self.output_ids

    def chunk_end(self, n: int, ready: Callable[[ImageItem], bool] | None = None) -> int:
        """How many of the next n tokens a prefill step may compute: the chunk ends before the first image
        in it that is not `ready` (encoded: scheduler/image_encoding.py; None: all are). Where an image's
        tokens attend each other both ways, the chunk ends before the image (or, starting inside it, after
        it), never inside."""
        start, end = self.num_computed_tokens, self.num_computed_tokens + n
        for im in self.images:
            a, b = im.offset, im.offset + im.length
            if a >= end:
                break
            if a >= start and ready is not None and not ready(im):
                return a - start
            if self.images_bidirectional and a < end < b:
                return (a if a > start else b) - start
        return n

    @property
    def seq_len(self) -> int:
        """Tokens the request holds, counting outputs still in flight."""
        return len(self.origin_input_ids) + len(self.output_ids) + self.num_output_placeholders

    @property
    def num_tokens_to_compute(self) -> int:
        return self.seq_len - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Its next tokens are a prefill's: prompt tokens, or more than one (a chunk, a retracted request's
        re-prefill). They draw on the step's prefill budget, take no draft tokens, and their committed KV is
        offered to the prefix cache as it goes. The one test of it: the scheduler asks here, before a step
        adds them."""
        return self.num_computed_tokens < len(self.origin_input_ids) or self.num_tokens_to_compute > 1

    @property
    def num_outputs_optimistic(self) -> int:
        return len(self.output_ids) + self.num_output_placeholders

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def held_prefix(self) -> Any:
        """The KV of the session turn it continues (a kv_cache.Hold), while the session holds it."""
        return None if self.session_turn is None else self.session_turn.hold

    @property
    def cache_protected_len(self) -> int:
        """Tokens of the row owned by the prefix cache, not by this request."""
        return 0 if self.prefix is None else self.prefix.length

    # ---- finishing ---------------------------------------------------------------------------
    def check_finished(self, matched_stop: StopMatch | None = None, grammar_done: bool = False) -> None:
        """The only place that sets finished_reason: from to_finish, length, a stop token, a stop
        string the caller found in the text (matched_stop), or the grammar's termination."""
        if self.finished_reason is not None:
            return
        if self.to_finish is not None:
            self.finished_reason = self.to_finish
            return
        if not self.output_ids:
            return
        last = self.output_ids[-1]
        n = len(self.output_ids)
        if n >= self.params.min_tokens:
            if last in self.stop_token_ids:
                self.finished_reason = FinishReason.stop(last)
                return
            if last in self.eos_token_ids and not self.params.ignore_eos:
                self.finished_reason = FinishReason.stop(last)
                return
            if matched_stop is not None:
                self.finished_reason = FinishReason.stop(matched_stop.stop, matched_stop.cut)
                return
        if grammar_done:
            self.finished_reason = FinishReason.stop()
            return
        if n >= self.max_new_tokens:
            self.finished_reason = FinishReason.length()

    @property
    def suppressed_ids(self) -> list[int]:
        """Tokens that may not be sampled before min_tokens outputs (EOS unless ignored, stop ids)."""
        ids = set(self.stop_token_ids)
        if not self.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    # ---- KV ownership --------------------------------------------------------------------------
    def pop_committed_kv_cache(self) -> tuple[int, int]:
        """Row range [cache_protected_len, kv_committed_len) of KV that is fact, handed over once."""
        if self._popped_committed:
            raise KVPopError(f"{self.rid}: committed KV popped twice")
        self._popped_committed = True
        return self.cache_protected_len, self.kv_committed_len

    def pop_overallocated_kv_cache(self) -> tuple[int, int]:
        """Row range [kv_committed_len, kv_allocated_len) handed out but never committed, once."""
        if self._popped_overallocated:
            raise KVPopError(f"{self.rid}: over-allocated KV popped twice")
        self._popped_overallocated = True
        return self.kv_committed_len, self.kv_allocated_len

    def reset_for_retract(self) -> None:
        """Back to waiting with no KV and its output kept; it re-prefills fill_ids."""
        self.req_pool_idx = None
        self.prefix = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.swa_released_len = 0
        self._popped_committed = False
        self._popped_overallocated = False
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_inflight_steps = 0
        self.needs_new_data = True
        self.prompt_lp_seen_this_epoch = 0
        self.epoch += 1
        self.time_stats.retractions.append(time.time())

    def __repr__(self) -> str:
        return (
            f"Req({self.rid}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
            f"computed={self.num_computed_tokens}, kv={self.kv_committed_len}/{self.kv_allocated_len}, "
            f"finished={self.finished_reason})"
        )

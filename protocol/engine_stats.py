"""The engine's counters, as `stats()` returns them: the scheduler's, with the frontend's filled in."""
from __future__ import annotations

import msgspec

from tandem.protocol.heap_sample import HeapSample


class EngineStats(msgspec.Struct, tag="stats", kw_only=True):  # 34 fields: by name, never by position
    rid: str
    kv_pool_size: int
    kv_free: int
    kv_cached: int  # slots held by the prefix cache, unlocked (evictable)
    kv_cache_locked: int  # slots of the prefix cache locked by running requests
    running: int
    waiting: int
    inflight_steps: int
    requests_finished: int
    requests_aborted: int
    requests_failed: int
    retractions: int
    steps: int
    prefill_tokens: int
    decode_tokens: int
    schedule_s: float  # scheduler CPU time spent forming steps
    worker_busy_s: float
    worker_idle_s: float  # worker idle gaps between steps (the bubble)
    integrity: str  # "ok" or what check_integrity() found
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified ...
    spec_accepted_tokens: int = 0  # ... and accepted
    spec_accepted_per_position: list[int] = []  # [j]: drafts accepted at draft position j
    frontend_pending: int = 0  # filled in by the frontend
    # Host KV tier (--host-kv-tokens): prompt tokens whose KV was copied back from it instead of computed.
    host_hit_tokens: int = 0
    host_kv_pool_size: int = 0
    host_kv_used: int = 0
    sessions_open: int = 0
    session_held_tokens: int = 0  # KV tokens the open sessions hold locked for their turns
    # The sliding-window layers' own KV pool (0: none): its slots, and those free.
    swa_kv_pool_size: int = 0
    swa_kv_free: int = 0
    draining: str = ""  # filled in by the frontend: why the engine is draining ("" while it serves)
    loras: dict[str, str] = {}  # the LoRA adapters served: name -> path (those unloading left out)
    images_encoded: int = 0  # images run through the encoder (those whose KV or encoding was kept are not)
    grammar_cache_bytes: int = 0  # compiled grammars cached (bounded: scheduler/grammar.py's CACHE_BYTES)
    worker_heap: HeapSample | None = None  # the latest heap sample from rank 0 (None: none yet, or not glibc)

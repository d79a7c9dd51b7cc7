"""Every message that crosses a process boundary. One tagged union per socket (see `codec.py`).

Socket map (docs/architecture.md §1):
  client  -> frontend     ClientMsg      frontend -> client     FrontendMsg
  frontend-> scheduler    SchedulerInMsg worker   -> scheduler  WorkerMsg
  scheduler-> worker      WorkerInMsg    scheduler-> detok      DetokInMsg
  detok   -> frontend     FrontendInMsg  any child -> launcher  LauncherMsg
  launcher-> frontend     EngineStopping, Drain (in FrontendInMsg)
Messages carry diffs: a new request once, then per step only what changed.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from tandem.protocol.embed_params import EmbedParams
from tandem.protocol.engine_stats import EngineStats
from tandem.protocol.final_info import FinalInfo, HasFinal
from tandem.protocol.heap_sample import HeapSample
from tandem.protocol.image_item import ImageItem
from tandem.protocol.lora_messages import LoadLora, LoraReply, LoraSlotLoad, UnloadLora
from tandem.protocol.sampling_params import SamplingParams
from tandem.protocol.session_messages import CloseSession, OpenSession, SessionReply
from tandem.protocol.stop_messages import Drain, Drained, DrainRequest, Stalled, WorkerFailed

# A request's priority (--scheduling-policy priority): lower is served first, as in vLLM; 0 by default.
Priority = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


class SessionParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A request that continues a session (OpenSession): its prompt is appended to the full context (prompt
    and output) of the session's turn `rid`, by default the latest, whose KV the session holds."""

    id: str
    rid: str | None = None


# ---- client <-> frontend -------------------------------------------------------------------
class GenerateRequest(msgspec.Struct, tag="generate"):
    rid: str
    # Exactly one of text / token_ids / messages is set (msgspec unions allow one array type).
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    # Raw so that a bad parameter is reported against this rid rather than dropping the message.
    params: msgspec.Raw = msgspec.Raw(b"{}")
    priority: Priority = 0
    session_params: SessionParams | None = None
    # With token_ids: the prompt's images, preprocessed by the client (frontend/image_prompt.py)
    images: list[ImageItem] = []
    lora: str | None = None  # the LoRA adapter to run under, by its name (--lora-modules); None: the base


class EmbedRequest(msgspec.Struct, tag="embed"):
    """Pool the model's final hidden states over one input (no decode): exactly one of text / token_ids."""

    rid: str
    text: str | None = None
    token_ids: list[int] | None = None
    params: msgspec.Raw = msgspec.Raw(b"{}")  # EmbedParams, raw for the same reason as GenerateRequest's
    priority: Priority = 0


class AbortRequest(msgspec.Struct, tag="abort"):
    rid: str


class Logprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at a run of positions, column-wise: for each position, the token that is there
    (sampled, or the prompt's) with its logprob, and the top-N alternatives."""

    token_ids: list[int] = []
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    def extend(self, other: Logprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


class EngineLoad(msgspec.Struct, array_like=True):
    """The scheduler's gauges and counters, riding with the outputs so that clients (the HTTP
    server's /metrics) see them without asking. Counters are totals since the engine started."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV slots held by requests (evictable cache counts as free)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_hits: int = 0  # of which found there
    preemptions: int = 0  # retractions
    # Speculative decoding: verify steps with drafts, draft tokens verified, accepted (all, and at each
    # draft position).
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []


class RequestOutput(msgspec.Struct, HasFinal, array_like=True):
    """A delta of one request: text and token ids since the previous one; the last one carries `final`."""

    rid: str
    text: str
    token_ids: list[int]
    final: FinalInfo | None = None
    logprobs: Logprobs | None = None  # for this delta's token_ids
    prompt_logprobs: Logprobs | None = None  # for prompt positions 1.. (position 0 has none)
    load: EngineLoad | None = None


class OutputBatch(msgspec.Struct, tag="outputs"):
    outputs: list[RequestOutput]


class EmbeddingOutput(msgspec.Struct, HasFinal, array_like=True):
    """An embedding request's one answer: the pooled vector (float32, little-endian), empty if aborted."""

    rid: str
    embedding: bytes
    final: FinalInfo | None = None
    load: EngineLoad | None = None


class EmbeddingBatch(msgspec.Struct, tag="embeddings"):
    """From the scheduler through the detokenizer (unchanged) and the frontend to the client."""

    outputs: list[EmbeddingOutput]


class RequestError(msgspec.Struct, tag="error"):
    """A request ended with an error (by the frontend, or by the engine: passed through unchanged)."""

    rid: str
    code: str
    message: str


class StatsRequest(msgspec.Struct, tag="stats_request"):
    """Ask the engine for its counters; the scheduler also runs its integrity check."""

    rid: str


ClientMsg = (
    GenerateRequest | EmbedRequest | AbortRequest | StatsRequest | OpenSession | CloseSession | DrainRequest
    | LoadLora | UnloadLora
)
FrontendMsg = OutputBatch | EmbeddingBatch | RequestError | EngineStats | SessionReply | LoraReply


# ---- frontend -> scheduler ------------------------------------------------------------------
class TokenizedRequest(msgspec.Struct, tag="req"):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    priority: int = 0
    session: SessionParams | None = None
    embed: EmbedParams | None = None  # an embedding request: pooled, never sampled
    images: list[ImageItem] = []  # checked, with their digests
    lora: str | None = None  # a served adapter's name (checked)


SchedulerInMsg = (
    TokenizedRequest | AbortRequest | StatsRequest | OpenSession | CloseSession | LoadLora | UnloadLora
)


# ---- scheduler -> worker ---------------------------------------------------------------------
class WorkerSampling(msgspec.Struct, array_like=True):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    repetition_penalty: float = 1.0  # over prompt and output tokens
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # until this many outputs, suppress_ids can't be sampled
    suppress_ids: list[int] = []  # EOS and stop token ids
    logprobs: int = -1  # top-N with each sampled token; -1: none
    prompt_logprobs: int = -1  # top-N at each prompt position; -1: none
    prompt_logprob_start: int = 0  # prompt logprobs for tokens at this index and after (logprob_start_len)


class NewReqData(msgspec.Struct, array_like=True):
    """A request's data, sent once when it (re)enters the running set."""

    req_pool_idx: int  # its row in the worker's persistent request state and req_to_token table
    token_ids: list[int]  # fill_ids at admission: prompt (+ outputs kept across a retraction)
    num_prompt: int
    num_cached: int  # leading tokens whose KV comes from the prefix cache: computed already
    sampling: WorkerSampling
    pool: EmbedParams | None = None  # an embedding request: its prompt's hidden states are pooled
    images: list[ImageItem] = []  # the prompt's, for the steps that compute their tokens
    lora_slot: int = -1  # the device slot of its adapter (-1: the base model)


class ScheduledReq(msgspec.Struct, array_like=True):
    """One request in one step: compute `num_tokens` tokens after the ones already computed."""

    req_pool_idx: int
    num_tokens: int
    # KV slots for req_to_token[req_pool_idx, slot_start : slot_start + len(slots)]; covers at least
    # the tokens computed this step (and a prefix-cache hit when the request is new).
    slot_start: int
    slots: list[int]
    sample: bool  # the step reaches the end of the known tokens: sample the next one
    # Speculation: the last num_drafts of num_tokens are the worker's own draft tokens (already in its
    # token buffer past the known ones); it verifies them and returns 1 + the accepted ones.
    num_drafts: int = 0
    # Sliding-window layers with a pool of their own: each of `slots`' slot in that pool (0: none); else [].
    swa_slots: list[int] = []


class KVCopies(msgspec.Struct, array_like=True):
    """Copies between the device KV pool and the host tier, slot for slot, all layers. The worker runs
    every to_host copy, then every to_device copy, before the step's forward: a device slot evicted to the
    host may be reused by this very step, and a loaded prefix is read by it."""

    to_host_src: list[int] = []  # device slots
    to_host_dst: list[int] = []  # host slots
    to_device_src: list[int] = []  # host slots
    to_device_dst: list[int] = []  # device slots


class EncodeWork(msgspec.Struct):
    """Run `pieces` more pieces (encoder layers) of an image's encoding. The image's pixels come with the
    first piece the scheduler sends; later ones name it by digest."""

    digest: str
    pieces: int
    image: ImageItem | None = None


class SchedulerOutput(msgspec.Struct, tag="step"):
    step_id: int
    # Rows freed since the previous step (their requests finished, were aborted or were retracted): the
    # worker drops them before new_reqs are added.
    freed_req_pool_indices: list[int]
    new_reqs: list[NewReqData]
    scheduled: list[ScheduledReq]
    # The engine had no work before this step: the worker's idle gap before it is not a bubble.
    after_idle: bool = False
    # Structured output: run input prep and the forward now, keep the logits, and sample only when the
    # SampleStep with the grammar bitmask arrives (it needs the previous step's tokens accepted first).
    defer_sample: bool = False
    kv_copies: KVCopies | None = None  # host KV tier traffic, run before this step's forward
    # Image encoding, run before this step's forward (a step may carry only this); the encodings in
    # progress of images no request needs any more are dropped first.
    encode: list[EncodeWork] = []
    encode_drop: list[str] = []
    # LoRA adapters into device slots, before this step's forward; adapters (name, generation) unloaded
    lora_loads: list[LoraSlotLoad] = []
    lora_forget: list[tuple[str, int]] = []


class SampleStep(msgspec.Struct, tag="sample"):
    """Sample a deferred step. `bitmask` is an int32 array [len(mask_rows), ceil(vocab/32)] (raw bytes),
    one row per constrained request, `mask_rows` their positions among the step's sampling requests."""

    step_id: int
    mask_rows: list[int]
    bitmask: bytes


class Shutdown(msgspec.Struct, tag="shutdown"):
    reason: str = ""


WorkerInMsg = SchedulerOutput | SampleStep | Shutdown


# ---- worker -> scheduler ---------------------------------------------------------------------
class ModelRunnerOutput(msgspec.Struct, tag="result"):
    step_id: int
    sampled: list[int]  # for each scheduled request with sample=True, in scheduled order, its tokens:
    num_sampled: list[int] | None = None  # how many of `sampled` each has (None: one each; more with drafts)
    # Drafts each sampling request really verified, where the worker decides (a CPU worker skips drafts
    # its proposer did not match); None: as scheduled.
    num_drafts: list[int] | None = None
    logprobs: list[Logprobs | None] | None = None  # per sampling request when any asked (None: the others)
    prompt_logprobs: dict[int, Logprobs] | None = None  # per row that asked: its chunk's prompt tokens
    busy_s: float = 0.0  # worker time spent on this step (input prep + forward + sample)
    idle_s: float = 0.0  # worker idle gap before this step (the bubble)
    # Per request row: the pooled vector of an embedding request whose prompt this step completed.
    embeddings: dict[int, bytes] | None = None
    heap: HeapSample | None = None  # every --heap-trim-period-s, on the step after it
    images_encoded: int = 0  # images this step ran through the encoder (not found in its cache)
    # digests of images whose encoding the step was asked to go on with but found kept already
    images_kept: list[str] | None = None


class WorkerReady(msgspec.Struct, tag="worker_ready"):
    """First message from rank 0: the memory the scheduler may hand out."""

    num_kv_slots: int  # usable slots 1..num_kv_slots (slot 0 is the padding slot)
    max_reqs: int
    max_context: int
    num_host_slots: int = 0  # the host KV tier's slots (--host-kv-tokens or --host-kv-memory-gb); 0: none
    num_swa_slots: int = 0  # the sliding-window layers' own pool (usable 1..n); 0: none


class StepFailed(msgspec.Struct, tag="step_failed"):
    """A step raised on the worker and produced no tokens; the worker serves on. `req_pool_indices`: the rows
    whose requests caused it (they fail); empty: no single request is to blame (all of the step fail)."""

    step_id: int
    req_pool_indices: list[int]
    code: str
    message: str


WorkerMsg = ModelRunnerOutput | StepFailed | WorkerFailed | WorkerReady  # WorkerFailed: to the launcher too


# ---- scheduler -> detokenizer -> frontend ---------------------------------------------------------
class DetokRegister(msgspec.Struct, tag="register"):
    rid: str
    prompt_tail: list[int]  # last prompt tokens: left context for decoders that need it
    skip_special_tokens: bool = True
    stop: list[str] = []  # stop strings: text that may begin one is held back until the scheduler decides


class TokenDelta(msgspec.Struct, HasFinal, array_like=True):
    rid: str
    token_ids: list[int]
    final: FinalInfo | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    load: EngineLoad | None = None
    stop_cut: int = 0  # a stop string ended it: characters to cut from the end of the text


class TokenBatch(msgspec.Struct, tag="tokens"):
    deltas: list[TokenDelta]


class EngineStopping(msgspec.Struct, tag="stopping"):
    """From the launcher, before it stops the engine: the frontend fails every waiting call with this
    reason."""

    reason: str
    code: str = "engine_dead"  # an ErrorCode of the engine_dead class


DetokInMsg = (
    DetokRegister | TokenBatch | EmbeddingBatch | RequestError | EngineStats | SessionReply | LoraReply
)
FrontendInMsg = (
    OutputBatch | EmbeddingBatch | RequestError | EngineStats | EngineStopping | SessionReply | Drain
    | LoraReply
)


# ---- child -> launcher -------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    role: str
    rank: int = 0
    info: str = ""


class Failed(msgspec.Struct, tag="failed"):
    role: str
    message: str


LauncherMsg = Ready | Failed | Stalled | DrainRequest | Drained | WorkerFailed

"""Engine configuration: one frozen dataclass; the CLI flags and `Client.launch(**options)` derive from it.

It crosses process boundaries msgspec-encoded (never pickled).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from tandem.protocol.choices import (
    AttentionBackend,
    Device,
    DType,
    HostKVPolicy,
    KVCacheDType,
    Pooling,
    SchedulingPolicyName,
    SpeculativeMethod,
    check_choices,
)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    mmproj: str | None = field(default=None, metadata={
        "help": "llama.cpp's multimodal projector GGUF for a GGUF text model (Gemma 3's): the model reads "
                "images, as llama.cpp's and ollama's vision files do"})
    # KV pool size in tokens; None: derive from kv_memory_fraction.
    kv_cache_tokens: int | None = None
    kv_memory_fraction: float = field(default=0.1, metadata={"help": "of device memory (RAM on CPU) for KV"})
    max_running_requests: int = 256
    max_waiting_requests: int | None = field(
        default=None,
        metadata={"help": "requests queued beyond the running ones; past it: overloaded; default: no limit"},
    )
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "per-step token budget"})
    scheduling_policy: SchedulingPolicyName = field(
        default="fcfs",
        metadata={
            "help": "fcfs (arrival order) or priority (a request's priority, lower first, "
            "then arrival; the lowest is retracted first)"
        },
    )
    chunked_prefill_tokens: int | None = field(
        default=None,
        metadata={"help": "prefill tokens per step, chunking long prompts; default: the step budget"},
    )
    encoder_tokens_per_step: int = field(default=32, metadata={
        "help": "image encoding a step may carry, in image tokens through one encoder layer (an image of T "
                "tokens costs T a layer; a layer larger runs alone): an image's encoding is spread over "
                "steps, so other requests are not held behind it"})
    lora_modules: list[str] = field(default_factory=list, metadata={"nargs": "+", "help": (
        "LoRA adapters to serve, name=path (a PEFT directory, or llama.cpp's LoRA .gguf file): a request "
        "picks one by name (--lora-modules a=DIR b=FILE.gguf, as vLLM's)")})
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters loaded while serving (the load/unload calls); on with --lora-modules"})
    max_loras: int = field(default=4, metadata={
        "help": "adapters on the device at once (more are swapped in as requests need them)"})
    max_lora_rank: int = field(default=64, metadata={"help": "the largest adapter rank served"})
    max_model_len: int | None = field(default=None, metadata={"help": "context limit; default: the model's"})
    page_size: int = field(
        default=1, metadata={"help": "KV page size in tokens; prefix cache keys are page-aligned"}
    )
    prefix_cache: bool = field(default=True, metadata={"help": "radix prefix cache"})
    host_kv_tokens: int = field(
        default=0,
        metadata={"help": "host KV tier under the prefix cache, in tokens (pinned RAM on CUDA); 0: off"},
    )
    host_kv_memory_gb: float | None = field(
        default=None,
        metadata={"help": "host KV tier size in GB (10^9 bytes) per worker, instead of --host-kv-tokens: "
                  "tokens = GB / the model's KV bytes per token at the KV dtype"},
    )
    host_kv_policy: HostKVPolicy = field(
        default="write_back", metadata={"help": "write_back (copy to host on eviction) or write_through"}
    )
    session_kv_tokens: int | None = field(
        default=None,
        metadata={"help": "KV tokens all open sessions may hold together (each reserves its capacity when it "
                  "opens); 0: no sessions; default: half of the KV pool"},
    )
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel ranks (worker processes)"})
    nnodes: int = field(default=1, metadata={"help": "nodes the tp ranks span"})
    node_rank: int = field(
        default=0, metadata={"help": "this node (0 runs scheduler, frontend, detokenizer)"}
    )
    dist_init_addr: str | None = field(
        default=None, metadata={"help": "host:port of node 0 for torch.distributed init across nodes"}
    )
    device: Device = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    dtype: DType = field(
        default="auto",
        metadata={
            "help": "auto (bf16 on CUDA; on CPU fp32 activations, a float checkpoint's weights in bf16 with "
            "AMX or AVX512-BF16, else fp32), float32, bfloat16, float16"
        },
    )
    kv_cache_dtype: KVCacheDType = field(
        default="auto",
        metadata={"help": "the KV pools' element: auto (the activations' dtype), float32, float16, bfloat16, "
                          "q8_0 (llama.cpp's blocks: 8 bits per value and a float16 scale per 32; head sizes "
                          "that are multiples of 32)"},
    )
    attention_backend: AttentionBackend = field(
        default="auto", metadata={"help": "auto (triton on CUDA, cpu on CPU), cpu, torch, triton"}
    )
    # None: on for a quantized GGUF file where the C kernels run (ModelRunner), as llama.cpp always runs one.
    cpu_int8_activations: bool | None = field(
        default=None,
        metadata={
            "help": "on CPU, a GGUF's quantized layers take their input quantized to 8 bits per 32 values "
            "and multiply in integers, as llama.cpp does (kernels/csrc/quant_int8.h). Default: on for a "
            "quantized file; --no-cpu-int8-activations: the exact float32 products"
        },
    )
    sliding_window_kv: bool = field(
        default=True,
        metadata={
            "help": "a model's sliding-window layers keep their KV in a pool of their own, and each request "
            "gives back the part every window has passed; off: they keep all of it in the full pool "
            "(also off under a host KV tier)"
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "no CUDA graphs: every decode step launches its kernels one by one"}
    )
    torch_threads: int | None = field(default=None, metadata={"help": "worker's torch intra-op threads"})
    async_scheduling: bool = True
    speculative_method: SpeculativeMethod | None = field(
        default=None, metadata={"help": "ngram: prompt-lookup draft tokens, verified in the forward"}
    )
    num_speculative_tokens: int = field(default=4, metadata={"help": "draft tokens per step (K)"})
    prompt_lookup_min: int = field(default=2, metadata={"help": "shortest n-gram the ngram drafter matches"})
    prompt_lookup_max: int = field(default=4, metadata={"help": "longest n-gram the ngram drafter matches"})
    seed: int = 0
    pooling: Pooling = field(
        default="last",
        metadata={
            "help": "embeddings pool the final hidden states of the prompt: last (its last "
            "token's, what causal embedding models train), mean (all tokens') or cls (the first's)"
        },
    )
    grammar_compile_timeout_s: float = field(
        default=30.0, metadata={"help": "per structured-output grammar; past it the request fails"}
    )
    debug_integrity: bool = field(default=False, metadata={"help": "check allocator invariants every step"})
    startup_timeout_s: float = 300.0
    step_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "a step not back from the workers after this long stops the engine, "
            "waiting calls get EngineDeadError naming the rank; default: max(60 s, 50x the "
            "longest step seen), the startup timeout until a step has finished"
        },
    )
    drain_timeout_s: float = field(
        default=30.0, metadata={"help": "on SIGTERM or POST /drain, running requests get this long to finish "
                                "while new ones are refused; the rest are then aborted (0: at once)"}
    )
    heap_trim_period_s: float = field(
        default=30.0,
        metadata={
            "help": "the worker hands its heap's free pages back to the OS this often, so a "
            "rare big step does not raise its RSS for good (0: never)"
        },
    )
    max_request_bytes: int = field(
        default=32 * 1024 * 1024, metadata={"help": "largest client message; larger ones get a typed error"}
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid engine option {name}={getattr(self, name)!r}: {why}")

        check_choices(type(self), vars(self), "engine")

        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 16:
            raise bad("kv_cache_tokens", "must be >= 16")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise bad("kv_memory_fraction", "must be in (0, 0.95]")
        if self.host_kv_tokens < 0:
            raise bad("host_kv_tokens", "must be >= 0")
        if self.host_kv_tokens and not self.prefix_cache:
            raise bad("host_kv_tokens", "needs the prefix cache (the host tier lives under it)")
        if self.host_kv_memory_gb is not None:
            if not self.host_kv_memory_gb > 0:  # also rejects NaN
                raise bad("host_kv_memory_gb", "must be > 0 (leave it unset for no host tier)")
            if self.host_kv_tokens:
                raise bad(
                    "host_kv_memory_gb", "give the host tier's size once: host_kv_tokens or host_kv_memory_gb"
                )
            if not self.prefix_cache:
                raise bad("host_kv_memory_gb", "needs the prefix cache (the host tier lives under it)")
        if self.host_kv_tokens % self.page_size:
            raise bad("host_kv_tokens", f"must be a multiple of page_size={self.page_size}")
        if self.session_kv_tokens is not None and self.session_kv_tokens < 0:
            raise bad("session_kv_tokens", "must be >= 0 (0: no sessions)")
        self._check_loras(bad)
        if self.encoder_tokens_per_step < 1:
            raise bad("encoder_tokens_per_step", "must be >= 1")
        if self.chunked_prefill_tokens is not None and self.chunked_prefill_tokens < 1:
            raise bad("chunked_prefill_tokens", "must be >= 1")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise bad("max_waiting_requests", "must be >= 0")
        if not self.grammar_compile_timeout_s > 0:
            raise bad("grammar_compile_timeout_s", "must be > 0")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise bad("step_timeout_s", "must be > 0 (leave it unset for the default from the step times)")
        if not self.drain_timeout_s >= 0:
            raise bad("drain_timeout_s", "must be >= 0")
        if not self.heap_trim_period_s >= 0:
            raise bad("heap_trim_period_s", "must be >= 0 (0: never)")
        for name in (
            "max_running_requests",
            "max_num_batched_tokens",
            "page_size",
            "tp_size",
            "max_request_bytes",
        ):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"must be in [0, nnodes={self.nnodes})")
        if self.tp_size % self.nnodes:
            raise bad("tp_size", f"must be a multiple of nnodes={self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise bad("dist_init_addr", "is required with nnodes > 1 (host:port of node 0)")
        if self.num_speculative_tokens < 1:
            raise bad("num_speculative_tokens", "must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise bad("prompt_lookup_max", f"must be >= prompt_lookup_min={self.prompt_lookup_min} >= 1")

    def _check_loras(self, bad: Callable[[str, str], ValueError]) -> None:
        from tandem.protocol.lora import LoraError, LoraModule

        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise bad("max_loras" if self.max_loras < 1 else "max_lora_rank", "must be >= 1")
        try:
            names = [LoraModule.parse(m).name for m in self.lora_modules]
        except LoraError as e:
            raise bad("lora_modules", str(e)) from None
        if len(set(names)) < len(names):
            raise bad("lora_modules", "two adapters under one name")

    @classmethod
    def from_options(cls, model: str, **options: object) -> EngineConfig:
        """Build from keyword options; an unknown option is an error (TypeError), never silently dropped, and
        a value of the wrong type or out of range a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        check_choices(cls, options, "engine")  # before msgspec, whose own message names no values
        try:  # msgspec checks each option's type (a str for a bool, a bool for an int) and runs __post_init__
            return msgspec.convert({"model": str(model), **options}, type=cls, strict=True)
        except msgspec.ValidationError as e:
            msg = str(e)
            raise ValueError(
                msg if msg.startswith("invalid engine option") else f"invalid engine option: {msg}"
            ) from None

    @property
    def host_tier(self) -> bool:
        """A host KV tier under the prefix cache, sized either way."""
        return bool(self.host_kv_tokens) or self.host_kv_memory_gb is not None

    @property
    def lora(self) -> bool:
        """The engine serves LoRA adapters (its layers hold --max-loras slots)."""
        return self.enable_lora or bool(self.lora_modules)

    @property
    def spec_tokens(self) -> int:
        """Draft tokens per step; 0 without speculation."""
        return self.num_speculative_tokens if self.speculative_method else 0

    def options(self) -> dict[str, object]:
        """Everything but the model: the keyword options of `Client.launch(model, **options)`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> EngineConfig:
        return msgspec.json.decode(data, type=cls)

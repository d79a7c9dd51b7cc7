"""A roofline for this machine and model: measured GEMM rates in the engine's dtype on the model's own
shapes plus memory bandwidth, and from them the least time a workload could take.

Measured in the benchmark's process before the engine starts (the engine's worker runs in its own process
with its own threads, so the two never compete for the cores).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.kernels.cpu_linear import pack_weight, packable, packed_linear
from tandem.kernels.native.cpu_caps import cpu_caps, usable_cores
from tandem.kernels.ops import resolve_ops
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.gguf_metadata import is_gguf, open_gguf
from tandem.protocol.gguf_tensor_index import gguf_linear_type
from tandem.protocol.model_config import read_model_config
from tandem.worker.device import resolve_device, resolve_weight_dtype
from tandem.worker.loader import quantized_types


def engine_dtype(cfg: EngineConfig) -> torch.dtype:
    """The dtype of the engine worker's float weights (what `--dtype auto` picks on this machine): what a
    decode step streams (on CPU with bf16 weights the activations and KV stay float32)."""
    gguf = gguf_linear_type(cfg.model) if is_gguf(cfg.model) else None
    return resolve_weight_dtype(cfg.dtype, resolve_device(cfg.device), gguf_weights=gguf)


def model_dims(cfg: EngineConfig) -> ModelDims:
    """The dimensions of the model the engine will run, in its dtype, weight storage and KV element."""
    dims = ModelDims.from_dir(cfg.model, engine_dtype(cfg), resolve_device(cfg.device).type)
    kv = KV_ELEMENT_BYTES.get(cfg.kv_cache_dtype)
    return dims if kv is None else replace(dims, kv_elem_bytes=kv)


# Bytes per K or V element a --kv-cache-dtype stores (auto: the activations').
KV_ELEMENT_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "q8_0": 34 / 32}


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: torch.dtype = torch.float32  # of the weights and the KV cache
    # Bytes of matmul weights as the worker holds them when that is not params x dtype (a GGUF whose blocks
    # stay quantized, worker/loader.py); None: params x dtype.
    stored_weight_bytes: int | None = None
    kv_elem_bytes: float | None = None  # None: dtype's

    @classmethod
    def from_dir(
        cls, model: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> ModelDims:
        """`model`: a HF directory or a .gguf file (on `device`, whose quantized weights may stay so)."""
        c = read_model_config(model)
        dims = cls(
            hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
            # an MoE model's MLP as a token reads it: its top-k experts (a batch may read more of them, so
            # for MoE the floor is looser, still a floor)
            kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate=c.active_intermediate_size,
            vocab=c.vocab_size, dtype=dtype,
        )
        kept = quantized_types(resolve_ops(device, dtype)) if is_gguf(model) else frozenset()
        if not kept:
            return dims
        stored = 0
        for t in open_gguf(model).tensors:
            held = int(t.n_bytes) if t.tensor_type.name in kept else int(t.n_elements) * dims.elem_bytes
            if len(t.shape) == 2:
                stored += held
            elif len(t.shape) == 3:  # an MoE layer's [E, ...] experts: a token reads its top k
                stored += held * c.num_experts_per_tok // c.num_experts
        if not c.tie_word_embeddings:  # the embedding is looked up, not streamed; the head is
            stored -= c.hidden_size * c.vocab_size * dims.elem_bytes
        return replace(dims, stored_weight_bytes=stored)

    def linears(self) -> dict[str, tuple[int, int, int]]:
        """name -> (in_features, out_features, how many per forward)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "qkv": (self.hidden, q + 2 * kv, self.layers),
            "o": (q, self.hidden, self.layers),
            "gate_up": (self.hidden, 2 * self.intermediate, self.layers),
            "down": (self.intermediate, self.hidden, self.layers),
            "lm_head": (self.hidden, self.vocab, 1),
        }

    @property
    def layer_params(self) -> int:
        """Matmul weights in all decoder layers (what every token passes through)."""
        return sum(k * n * c for name, (k, n, c) in self.linears().items() if name != "lm_head")

    @property
    def matmul_params(self) -> int:
        return self.layer_params + self.hidden * self.vocab

    @property
    def elem_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step must stream from memory: every matmul weight, as the worker holds it."""
        if self.stored_weight_bytes is not None:
            return self.stored_weight_bytes
        return self.matmul_params * self.elem_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        elem = self.elem_bytes if self.kv_elem_bytes is None else self.kv_elem_bytes
        return self.layers * 2 * self.kv_heads * self.head_dim * elem

    @property
    def attn_flops_per_pair(self) -> int:
        """QK^T and PV, 2 FLOPs per multiply-add, over every query head and layer, per (query, key) pair."""
        return 2 * 2 * self.layers * self.heads * self.head_dim


@dataclass
class Machine:
    prefill_m: int
    decode_m: int
    prefill_gflops: float  # time-weighted over one forward's linears at M = prefill_m
    decode_gflops: float
    bandwidth_gbs: float  # bytes read + written per second by a large copy
    prefill_gflops_by_linear: dict[str, float]
    decode_gflops_by_linear: dict[str, float]
    threads: int
    dtype: str  # the GEMM rates are of this dtype
    cpu: str  # model, usable cores and the matmul-relevant flags


@torch.inference_mode()
def _linear_rates(dims: ModelDims, m: int, min_time_s: float) -> tuple[float, dict[str, float]]:
    by_linear: dict[str, float] = {}
    total_flops = total_time = 0.0
    for name, (k, n, count) in dims.linears().items():
        # The product the engine's layers run: oneDNN on the packed weight where the worker packs it
        # (CPU float32, kernels/cpu_linear.py), F.linear elsewhere.
        x, w = torch.randn(m, k, dtype=dims.dtype), torch.randn(n, k, dtype=dims.dtype)
        product = partial(packed_linear, x, pack_weight(w)) if packable(w) else partial(F.linear, x, w)
        product()  # warm-up: first-call allocation and kernel selection
        # The fastest call: a peak rate is what a floor needs, and it shrugs off other processes' bursts.
        reps, per_call, start = 0, float("inf"), time.perf_counter()
        while reps < 5 or time.perf_counter() - start < min_time_s:
            t0 = time.perf_counter()
            product()
            per_call = min(per_call, time.perf_counter() - t0)
            reps += 1
        flops = 2.0 * m * k * n
        by_linear[name] = flops / per_call / 1e9
        total_flops += flops * count
        total_time += per_call * count
    return total_flops / total_time / 1e9, by_linear


@torch.inference_mode()
def _copy_bandwidth(nbytes: int = 256 << 20, reps: int = 8) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def measure(dims: ModelDims, prefill_m: int, decode_m: int, min_time_s: float = 0.2) -> Machine:
    threads = usable_cores()
    torch.set_num_threads(threads)
    pre, pre_by = _linear_rates(dims, prefill_m, min_time_s)
    dec, dec_by = _linear_rates(dims, decode_m, min_time_s)
    return Machine(prefill_m, decode_m, pre, dec, _copy_bandwidth(), pre_by, dec_by, threads,
                   str(dims.dtype).removeprefix("torch."), cpu_caps().describe())


@dataclass
class OfflineFloor:
    prefill_s: float
    decode_s: float
    output_tokens: int

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.total_s


def offline_floor(dims: ModelDims, mach: Machine, prompt_lens: list[int], output_len: int) -> OfflineFloor:
    """Least time for: every prompt prefilled (its first output token from the prefill's logits), then
    groups of decode_m requests decoding together for the remaining output_len - 1 steps."""
    pairs = sum(n * (n + 1) // 2 for n in prompt_lens)  # causal (query, key) pairs
    # lm_head runs only at each prompt's last position; every prompt token goes through the layers.
    prefill_flops = (
        2 * dims.layer_params * sum(prompt_lens)
        + 2 * dims.hidden * dims.vocab * len(prompt_lens)
        + dims.attn_flops_per_pair * pairs
    )
    prefill_s = prefill_flops / (mach.prefill_gflops * 1e9)
    dec_rate, bw = mach.decode_gflops * 1e9, mach.bandwidth_gbs * 1e9
    decode_s = 0.0
    for g in range(0, len(prompt_lens), mach.decode_m):
        group = prompt_lens[g : g + mach.decode_m]
        b = len(group)
        for step in range(1, output_len):
            ctx = sum(group) + b * step  # keys each query attends to, summed over the batch
            linears = max(2 * dims.matmul_params * b / dec_rate, dims.weight_bytes / bw)
            attention = max(dims.attn_flops_per_pair * ctx / dec_rate, dims.kv_bytes_per_token * ctx / bw)
            decode_s += linears + attention
    return OfflineFloor(prefill_s, decode_s, len(prompt_lens) * output_len)


def batch1_decode_floor_tok_s(dims: ModelDims, mach: Machine, prompt_len: int, output_len: int) -> float:
    """Memory roofline for one sequence decoding: all weights plus its mean KV read once per token."""
    mean_ctx = prompt_len + output_len / 2
    step_bytes = dims.weight_bytes + dims.kv_bytes_per_token * mean_ctx
    return mach.bandwidth_gbs * 1e9 / step_bytes


def describe(mach: Machine) -> str:
    def rates(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in d.items())

    return (
        f"{mach.cpu}\n"
        f"roofline ({mach.threads} threads): {mach.dtype} GEMM prefill M={mach.prefill_m}: {mach.prefill_gflops:.1f} "
        f"GFLOP/s [{rates(mach.prefill_gflops_by_linear)}]\n"
        f"  decode M={mach.decode_m}: {mach.decode_gflops:.1f} GFLOP/s [{rates(mach.decode_gflops_by_linear)}]\n"
        f"  memory bandwidth (copy, read+write): {mach.bandwidth_gbs:.1f} GB/s"
    )


def machine_dict(mach: Machine) -> dict[str, object]:
    return asdict(mach)

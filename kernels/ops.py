"""Which implementation of every op the engine runs, chosen once per worker by `resolve_ops`.

The runner resolves an `Ops` at start and hands it to input prep, attention, the layers and speculation;
nothing else picks a kernel. Three families: the Triton kernels (the CUDA default), the C kernels of
kernels/native/ (CPU in float32, when they build) and the plain-torch references (everything else). This
is the only reader of the two switches: TANDEM_TRITON=0/1 forces the torch references or the Triton kernels
for the device-side ops (=1 on CPU needs TRITON_INTERPRET=1), TANDEM_NO_NATIVE=1 turns the C kernels off.
"""

from __future__ import annotations

import functools
import logging
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kernels.linear_product import linear_product
from tandem.kernels.native import lora, moe, norm_act, paged_attention, quant_bf16, quant_linear, rotary
from tandem.kernels.native.cpu_caps import cpu_caps
from tandem.kernels.reference import bitmask as ref_bitmask
from tandem.kernels.reference import input_prep as ref_input_prep
from tandem.kernels.reference import lora as ref_lora
from tandem.kernels.reference import moe as ref_moe
from tandem.kernels.reference import ngram_propose as ref_ngram
from tandem.kernels.reference import norm_act as ref_norm_act
from tandem.kernels.reference import rotary as ref_rotary
from tandem.kernels.reference import scatter_2d as ref_scatter
from tandem.kernels.triton import bitmask as tri_bitmask
from tandem.kernels.triton import input_prep as tri_input_prep
from tandem.kernels.triton import lora as tri_lora
from tandem.kernels.triton import moe as tri_moe
from tandem.kernels.triton import ngram_propose as tri_ngram
from tandem.kernels.triton import scatter_2d as tri_scatter
from tandem.kernels.weight_forms import WeightForms, weight_forms
from tandem.protocol.choices import AttentionBackend

log = logging.getLogger(__name__)

ATTENTION_BACKENDS: tuple[str, ...] = typing.get_args(AttentionBackend)
# Rows from which a GGUF weight's product on the int8 path takes the hardware bf16 matmul on the weight
# widened for the call: on a 1B model's 8192 x 2048 Q4_K layer (Sapphire Rapids, 2 threads) the int8
# kernel and widen-then-AMX were even at 128 rows, the latter 1.7-2.2x faster at 512 (widening: 5.6 ms).
# Decode batches stay below it (the step graph records the int8 kernel).
BF16_BLOCK_ROWS = 256


@dataclass(frozen=True)
class Ops:
    """One implementation per op (signatures: the reference of each, kernels/reference/)."""

    attention: str  # the attention backend: cpu, torch or triton
    native: bool  # the C kernels run (norm, SiLU, rotary, CPU attention, quantized GGUF weights, MoE layers)
    # GGUF blocks' products take int8 activations (--cpu-int8-activations; kernels/csrc/quant_int8.h)
    int8_activations: bool
    # from this many rows a GGUF weight's product (on the int8 path) is the hardware's bf16 one on its
    # blocks widened to bf16 for the call (kernels/native/quant_bf16.py); None: never (the exact path, or
    # no bf16 matmul)
    bf16_block_rows: int | None
    host_drafts: bool  # the n-gram proposer runs on the host and returns each row's matched drafts
    cuda_graphs: bool  # decode steps may be captured as CUDA graphs (worker/decode_graphs.py)
    weights: WeightForms  # the form each weight takes for these kernels (kernels/weight_forms.py)
    prepare_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # table[rows, cols] = values: the block table's new KV slots, the sampled tokens into the token buffer
    scatter_2d: Callable[..., None]
    propose_ngram: Callable[..., list[int] | None]
    apply_bitmask: Callable[..., None]
    add_rms_norm: Callable[..., torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_mul: Callable[[torch.Tensor], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # an MoE layer's experts from torch weights (where `native`, the layer runs kernels/native/moe.py instead)
    moe_experts: Callable[..., torch.Tensor]
    # router logits -> (top-k weights, expert ids) for moe_experts (torch everywhere: one small softmax)
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # a linear layer's product from the form of its weight it holds (kernels/linear_product.py)
    linear: Callable[..., torch.Tensor]
    # a whole MoE layer in the C kernel (router, top-k, experts) from its packed weights: (x, w13, w2, top_k,
    # renormalize, router) -> y; only where `native`
    moe_layer: Callable[..., torch.Tensor]
    # LoRA deltas of a step mixing adapters, added to a linear layer's output (kernels/reference/lora.py)
    lora_add: Callable[..., torch.Tensor]

    def describe(self) -> str:
        device_ops = "host" if self.host_drafts else "triton"
        return (
            f"ops: attention={self.attention} native={self.native} int8-activations={self.int8_activations} "
            f"bf16-block-rows={self.bf16_block_rows} input-prep/drafts={device_ops}"
        )


def _native_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    # Qwen3's per-head q/k norms take [T, heads, D] views; the C pass takes matrices with contiguous rows.
    if x.dim() == 2 and x.stride(1) == 1 and (delta is None or delta.stride(1) == 1):
        return norm_act.add_rms_norm(x, delta, weight, eps)
    if delta is None and x.dim() == 3 and x.stride(2) == 1:  # each head a row (what the CPU step graph runs)
        return norm_act.add_rms_norm(x.reshape(-1, x.shape[2]), None, weight, eps).view(x.shape)
    return ref_norm_act.add_rms_norm(x, delta, weight, eps)


def _native_moe_layer(x: torch.Tensor, w13: moe.ExpertWeights, w2: moe.ExpertWeights, top_k: int,
                      renormalize: bool, router: torch.Tensor) -> torch.Tensor:
    return moe.moe(x, w13, w2, top_k, renormalize, router=router)[0]


def _no_moe_layer(*args: object) -> torch.Tensor:
    raise RuntimeError("the C MoE kernel does not run here (its layer runs the router and Ops.moe_experts)")


def resolve_ops(
    device: torch.device | str, dtype: torch.dtype, attention: str = "auto",
    int8_activations: bool | None = False,
) -> Ops:
    """The ops for a worker on `device` running `dtype`; attention: one of ATTENTION_BACKENDS (`auto`: triton
    on CUDA, cpu elsewhere; `triton` off CUDA needs TRITON_INTERPRET=1); int8_activations: the quantized
    products' int8 path, where the C kernels run (elsewhere ignored: with a warning when asked for, silently
    when None, the default's "where it can"). Builds the C kernels it picks now, not in the first request's
    step."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}; known: {', '.join(ATTENTION_BACKENDS)}")
    device = torch.device(device)
    forced = os.environ.get("TANDEM_TRITON")
    triton = forced == "1" if forced in ("0", "1") else device.type == "cuda"
    native = (
        device.type == "cpu" and dtype == torch.float32 and os.environ.get("TANDEM_NO_NATIVE") != "1"
        and all(k.available() for k in (norm_act, rotary, paged_attention, quant_linear, moe, lora))
    )
    if int8_activations and not native:
        log.warning("--cpu-int8-activations ignored: it needs the C kernels (CPU, float32, a C compiler)")
    int8 = (int8_activations is None or int8_activations) and native  # one value for every reader below
    if attention == "auto":
        attention = "triton" if device.type == "cuda" else "cpu"
    bf16_rows = BF16_BLOCK_ROWS if int8 and cpu_caps().fast_bf16 and quant_bf16.available() else None
    ops = Ops(
        attention=attention,
        native=native,
        int8_activations=int8,
        bf16_block_rows=bf16_rows,
        host_drafts=not triton,
        cuda_graphs=device.type == "cuda",
        weights=weight_forms(native),
        prepare_inputs=tri_input_prep.prepare_inputs_triton if triton else ref_input_prep.prepare_inputs_ref,
        scatter_2d=tri_scatter.scatter_2d_triton if triton else ref_scatter.scatter_2d_ref,
        propose_ngram=tri_ngram.propose_ngram_triton if triton else ref_ngram.propose_ngram_ref,
        apply_bitmask=tri_bitmask.apply_bitmask_triton if triton else ref_bitmask.apply_bitmask_ref,
        add_rms_norm=_native_add_rms_norm if native else ref_norm_act.add_rms_norm,
        silu_mul=norm_act.silu_mul if native else ref_norm_act.silu_mul_ref,
        gelu_mul=norm_act.gelu_mul if native else ref_norm_act.gelu_mul_ref,
        rotary=rotary.rotary if native else ref_rotary.apply_rotary_ref,
        moe_experts=tri_moe.experts_triton if triton else ref_moe.experts_ref,
        moe_route=ref_moe.route_ref,
        linear=functools.partial(linear_product, int8=int8, bf16_rows=bf16_rows),
        moe_layer=_native_moe_layer if native else _no_moe_layer,
        lora_add=tri_lora.lora_add_triton if triton else lora.lora_add if native else ref_lora.lora_add_ref,
    )
    log.info("%s (device %s, %s)", ops.describe(), device, dtype)
    return ops

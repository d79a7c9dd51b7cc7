"""Device and dtype choice: bf16 on CUDA; on CPU fp32 activations, with a float checkpoint's (or a BF16
GGUF file's) linear weights in bf16 where the CPU has native bf16 matmuls, an F16 file's in float16 (a
quantized file keeps its blocks)."""
from __future__ import annotations

import torch

from tandem.kernels.native.cpu_caps import CpuCaps, cpu_caps
from tandem.kernels.reference.kv_quant import Q8_0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The activations' dtype. `auto`: bf16 on CUDA, fp32 on CPU, where the C kernels of a decode step (the
    linear products from blocks or float weights, norms, rotary, attention: the CPU step graph) take fp32,
    as llama.cpp runs a model's activations in fp32 whatever its weights' type (resolve_weight_dtype)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pools' element for --kv-cache-dtype `name` under activations of `dtype`: `auto` is dtype, q8_0
    is uint8 (its blocks' bytes, kernels/reference/kv_quant.py)."""
    if name == "q8_0":
        return Q8_0
    return dtype if name == "auto" else resolve_dtype(name, device)


def resolve_weight_dtype(name: str, device: torch.device, caps: CpuCaps | None = None,
                         gguf_weights: str | None = None) -> torch.dtype:
    """The float linear weights' dtype (the LM head's too). The activations' (resolve_dtype) but for `auto`
    on a CPU with AMX or AVX512-BF16 and a float checkpoint: bf16 weights with fp32 activations, as
    llama.cpp runs a BF16 GGUF: a decode step streams half the bytes (the C kernel widens them exactly as
    it loads them) and many rows take the hardware's bf16 products. Elsewhere bf16 matmuls are emulated and
    slower than fp32. gguf_weights: a GGUF file's type of linear weights (gguf_linear_type): a BF16 file is
    that checkpoint already (its bf16 weights kept exactly on any CPU, not widened to twice the bytes: where
    the CPU has no bf16 products torch widens them per call for many rows, kernels/cpu_linear.py, as the C
    kernel does as it loads them; measured on the AVX2 class, widening at load made decode 0.90x
    llama.cpp's); an F16 file's stay float16 on any CPU (the C kernel widens them exactly as it loads them,
    as llama.cpp reads them: a step streams half of float32's bytes for the same products; torch widens them
    per call for many rows, kernels/cpu_linear.py); a quantized file keeps its blocks, and an F32 file's
    weights stay float32."""
    if name == "auto" and device.type == "cpu" and gguf_weights in ("F16", "BF16"):
        return torch.float16 if gguf_weights == "F16" else torch.bfloat16
    if name == "auto" and device.type == "cpu" and gguf_weights is None and (caps or cpu_caps()).fast_bf16:
        return torch.bfloat16
    return resolve_dtype(name, device)

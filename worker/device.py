"""Device and dtype choice: bf16 on CUDA and on CPUs with native bf16 matmuls, fp32 elsewhere (and for a GGUF
file on CPU)."""
from __future__ import annotations

import torch

from kernels.native.cpu_caps import CpuCaps, cpu_caps


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, caps: CpuCaps | None = None, gguf: bool = False) -> torch.dtype:
    """`auto`: bf16 on CUDA; on CPU bf16 only with AMX or AVX512-BF16 (elsewhere bf16 matmuls are
    emulated and slower than fp32), and fp32 for a GGUF file (`gguf`): the CPU's quantized kernels compute
    in fp32 straight from the file's blocks, where bf16 would dequantize every layer (as llama.cpp, which
    runs a GGUF's activations in fp32)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if (caps or cpu_caps()).fast_bf16 and not gguf else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]

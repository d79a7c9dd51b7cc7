"""CPU capability parsing, `--dtype auto` by hardware, and the attention backend choice."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.native.cpu_caps import cpu_caps, parse_cpuinfo
from tandem.kernels.ops import resolve_ops
from tandem.protocol.engine_config import EngineConfig
from tandem.worker.attention_backend import select_attention_backend
from tandem.worker.device import resolve_dtype, resolve_weight_dtype

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: ignored
flags\t\t: fpu
"""


def test_parse_cpuinfo_reads_first_processor() -> None:
    caps = parse_cpuinfo(CPUINFO, cores=4)
    assert caps.model == "Intel(R) Xeon(R) Platinum 8480+" and caps.cores == 4
    assert caps.fast_bf16 and "amx_bf16" in caps.describe() and "4 cores" in caps.describe()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [("avx2 fma", torch.float32), ("avx2 avx512f", torch.float32), ("avx512f avx512_bf16", torch.bfloat16),
     ("amx_bf16 amx_tile", torch.bfloat16)],
)
def test_auto_dtype_follows_cpu_flags(flags: str, expected: torch.dtype) -> None:
    """On CPU `auto` computes in float32 and keeps a float checkpoint's linear weights in bf16 where the CPU
    multiplies bf16 natively (a BF16 GGUF file's too); explicit dtypes win; a quantized GGUF file keeps its
    blocks, an F32 one its float32 weights, an F16 one its halves on any CPU (widened exactly in the
    product)."""
    caps = parse_cpuinfo(f"model name\t: X\nflags\t\t: {flags}\n", cores=2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_weight_dtype("auto", cpu, caps) == expected
    assert resolve_weight_dtype("float32", cpu, caps) == torch.float32
    assert resolve_weight_dtype("bfloat16", cpu, caps) == resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", cuda) == resolve_weight_dtype("auto", cuda, caps) == torch.bfloat16
    for quantized in ("Q4_K", "Q8_0", "F32"):  # blocks kept; F32 exact in float32
        assert resolve_weight_dtype("auto", cpu, caps, gguf_weights=quantized) == torch.float32
    assert resolve_weight_dtype("auto", cpu, caps, gguf_weights="F16") == torch.float16
    assert resolve_weight_dtype("float32", cpu, caps, gguf_weights="F16") == torch.float32
    assert resolve_weight_dtype("auto", cpu, caps, gguf_weights="BF16") == expected  # a bf16 checkpoint
    assert resolve_weight_dtype("bfloat16", cpu, caps, gguf_weights="Q4_K") == torch.bfloat16


def test_this_machine_is_described() -> None:
    caps = cpu_caps()
    assert caps.cores >= 1 and caps.describe().startswith("CPU: ")


def test_attention_backend_choice() -> None:
    assert select_attention_backend(resolve_ops("cpu", torch.float32)).name == "cpu"
    assert select_attention_backend(resolve_ops("cuda", torch.bfloat16)).name == "triton"
    for name in ("cpu", "torch", "triton"):
        assert select_attention_backend(resolve_ops("cpu", torch.float32, name)).name == name
    for gone in ("flash", "torch-runs", "torch-gather"):  # the comparison-only backends went
        with pytest.raises(ValueError, match="unknown attention backend"):
            resolve_ops("cpu", torch.float32, gone)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="flash")

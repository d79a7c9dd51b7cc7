"""CPU capability parsing, `--dtype auto` by hardware, and the attention backend choice."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.native.cpu_caps import (
    ISA_CLASSES,
    ISA_ENV,
    cpu_caps,
    isa_class,
    isa_env,
    limited_to,
    parse_cpuinfo,
)
from tandem.kernels.ops import resolve_ops
from tandem.protocol.engine_config import EngineConfig
from tandem.worker.attention_backend import select_attention_backend
from tandem.worker.device import resolve_dtype, resolve_weight_dtype
from tests.c_kernels import needs_c_kernels

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
    multiplies bf16 natively (a BF16 GGUF file's on any CPU); explicit dtypes win; a quantized GGUF file keeps its
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
    # a bf16 checkpoint: kept on any CPU (widened per call for many rows where there are no bf16 products)
    assert resolve_weight_dtype("auto", cpu, caps, gguf_weights="BF16") == torch.bfloat16
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


SPR_FLAGS = ("fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 "
             "avx512vbmi avx_vnni amx_bf16 amx_int8 amx_tile")


@pytest.mark.parametrize(("isa", "kept", "lost", "fast_bf16"), [
    ("avx2", {"avx2", "fma", "f16c"}, {"avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "avx512_bf16"}, False),
    ("avx512", {"avx512f", "avx512bw", "avx2"}, {"avx512_vnni", "avx512_bf16", "amx_bf16", "avx512vbmi"}, False),
    ("avx512-vnni", {"avx512f", "avx512_vnni"}, {"avx512_bf16", "amx_int8", "avx512_fp16"}, False),
    ("avx512-bf16", {"avx512_vnni", "avx512_bf16", "avx512vbmi"}, {"amx_bf16", "amx_tile", "avx_vnni"}, True),
])
def test_a_class_of_machines_keeps_its_flags(monkeypatch, isa: str, kept: set, lost: set, fast_bf16: bool) -> None:
    """TANDEM_CPU_ISA: a Sapphire Rapids measures what an AVX2 or an AVX-512 machine without AMX runs: the
    flags such a machine lacks are gone (so `auto`'s dtype and the kernels' paths follow), the C kernels are
    built for its -march, oneDNN and ATen are limited alike."""
    caps = limited_to(parse_cpuinfo(f"model name\t: SPR\nflags\t\t: {SPR_FLAGS}\n", cores=2), isa)
    assert kept <= caps.flags and not lost & caps.flags and caps.fast_bf16 == fast_bf16
    assert caps.isa == isa and caps.march == ISA_CLASSES[isa].march and isa in caps.describe()
    monkeypatch.setenv(ISA_ENV, isa)
    assert isa_class() == isa
    env = isa_env(isa)
    assert env[ISA_ENV] == isa and env["ONEDNN_MAX_CPU_ISA"].startswith(("AVX2", "AVX512_CORE"))
    assert env["ATEN_CPU_CAPABILITY"] in ("avx2", "avx512")
    native = parse_cpuinfo(f"model name\t: SPR\nflags\t\t: {SPR_FLAGS}\n", cores=2)
    assert limited_to(native, "native") == native and native.march == "native"


def test_an_unknown_class_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="avx1024.*native, avx2"):
        isa_class()


@pytest.mark.slow  # a build of the largest kernel
@needs_c_kernels
def test_the_kernels_are_built_for_the_class(monkeypatch, tmp_path) -> None:
    """Under the avx2 class no AVX-512 instruction is in the built library (its registers never named),
    where this CPU's own build has them if it has AVX-512."""
    import subprocess

    from tandem.kernels.native import build as native_build
    from tandem.kernels.native import quant_linear

    def zmm_lines(isa: str) -> int:
        monkeypatch.setenv(ISA_ENV, isa)
        if isa != "native":  # this CPU's build is the one the suite already made
            monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / isa))
        cpu_caps.cache_clear()
        lib = native_build.build(quant_linear.SOURCE)
        return subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True, check=True
                              ).stdout.count("%zmm")

    try:
        assert zmm_lines("avx2") == 0
        if "avx512f" in parse_cpuinfo(open("/proc/cpuinfo").read(), 1).flags:
            assert zmm_lines("native") > 0
    finally:
        cpu_caps.cache_clear()

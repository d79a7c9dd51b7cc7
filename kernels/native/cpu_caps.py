"""What this CPU offers for matmuls (read from /proc/cpuinfo), for the dtype choice and benchmark reports.

TANDEM_CPU_ISA limits that to a class of machines (IsaClass below): the flags kept, the C kernels built for
it rather than -march=native, and what oneDNN and ATen may use (isa_env, set before torch loads: the engine's
processes start with it). One machine then measures what a machine of that class runs, beside a llama.cpp
built for the same class."""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

CpuIsa = Literal["native", "avx2", "avx512", "avx512-vnni", "avx512-bf16"]
ISA_ENV = "TANDEM_CPU_ISA"


@dataclass(frozen=True)
class IsaClass:
    dropped: tuple[str, ...]  # cpuinfo flags (and any flag starting with one of them) such a machine lacks
    march: str  # gcc's -march for the C kernels
    onednn: str  # ONEDNN_MAX_CPU_ISA
    aten: str  # ATEN_CPU_CAPABILITY


_NO_AMX = ("amx", "avx512_fp16", "avx_vnni", "avx_ifma", "avx512_vp2intersect")
ISA_CLASSES: dict[str, IsaClass] = {
    # Haswell to Zen 3: AVX2, FMA, F16C
    "avx2": IsaClass(("avx512", *_NO_AMX), "x86-64-v3", "AVX2", "avx2"),
    # Skylake-X: AVX-512 without VNNI or BF16
    "avx512": IsaClass(("avx512_vnni", "avx512_bf16", "avx512vbmi", "avx512_vbmi", "avx512ifma",
                        "avx512_bitalg", "avx512_vpopcntdq", *_NO_AMX),
                       "skylake-avx512", "AVX512_CORE", "avx512"),
    # Cascade Lake: AVX-512 with VNNI
    "avx512-vnni": IsaClass(("avx512_bf16", *_NO_AMX), "cascadelake", "AVX512_CORE_VNNI", "avx512"),
    # Cooper Lake, Zen 4 and 5: AVX-512 with VNNI and BF16, no AMX
    "avx512-bf16": IsaClass(_NO_AMX, "cooperlake", "AVX512_CORE_BF16", "avx512"),
}


def isa_class() -> CpuIsa:
    """TANDEM_CPU_ISA (native when unset); ValueError for a name it does not know."""
    name = os.environ.get(ISA_ENV, "native") or "native"
    if name not in get_args(CpuIsa):
        raise ValueError(f"{ISA_ENV}={name!r}: expected one of {', '.join(get_args(CpuIsa))}")
    return name  # type: ignore[return-value]


def isa_env(isa: CpuIsa) -> dict[str, str]:
    """The environment a process needs, set before torch loads, to run as a machine of class `isa`."""
    if isa == "native":
        return {ISA_ENV: "native"}
    c = ISA_CLASSES[isa]
    return {ISA_ENV: isa, "ONEDNN_MAX_CPU_ISA": c.onednn, "ATEN_CPU_CAPABILITY": c.aten}

# The flags that decide the dtype or explain a figure, in the order they are reported.
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class CpuCaps:
    model: str
    flags: frozenset[str]
    cores: int  # cores this process may run on (its affinity mask), not the machine's
    isa: CpuIsa = "native"

    @property
    def march(self) -> str:
        """gcc's -march for the C kernels: this CPU, or the class it is limited to."""
        return "native" if self.isa == "native" else ISA_CLASSES[self.isa].march

    @property
    def fast_bf16(self) -> bool:
        """bf16 matmuls in hardware: AMX tiles or AVX512-BF16 dot products."""
        return "amx_bf16" in self.flags or "avx512_bf16" in self.flags

    def describe(self) -> str:
        have = [f for f in REPORTED_FLAGS if f in self.flags] or ["none of " + "/".join(REPORTED_FLAGS)]
        limited = "" if self.isa == "native" else f" (limited to the {self.isa} class, {ISA_ENV})"
        return f"CPU: {self.model}, {self.cores} cores usable, flags: {' '.join(have)}{limited}"


def parse_cpuinfo(text: str, cores: int) -> CpuCaps:
    """The first processor's model name and flags."""
    model: str | None = None
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags":
            flags = frozenset(value.split())
            break
    return CpuCaps(model or platform.processor() or "unknown", flags, cores)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.cache
def cpu_caps() -> CpuCaps:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    return limited_to(parse_cpuinfo(text, usable_cores()), isa_class())


def limited_to(caps: CpuCaps, isa: CpuIsa) -> CpuCaps:
    """caps as a machine of class `isa` has them: the flags it lacks dropped."""
    if isa == "native":
        return caps
    dropped = ISA_CLASSES[isa].dropped
    return CpuCaps(caps.model, frozenset(f for f in caps.flags if not f.startswith(dropped)), caps.cores, isa)

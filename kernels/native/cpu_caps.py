"""What this CPU offers for matmuls (read from /proc/cpuinfo), for the dtype choice and benchmark reports."""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The flags that decide the dtype or explain a figure, in the order they are reported.
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class CpuCaps:
    model: str
    flags: frozenset[str]
    cores: int  # cores this process may run on (its affinity mask), not the machine's

    @property
    def fast_bf16(self) -> bool:
        """bf16 matmuls in hardware: AMX tiles or AVX512-BF16 dot products."""
        return "amx_bf16" in self.flags or "avx512_bf16" in self.flags

    def describe(self) -> str:
        have = [f for f in REPORTED_FLAGS if f in self.flags] or ["none of " + "/".join(REPORTED_FLAGS)]
        return f"CPU: {self.model}, {self.cores} cores usable, flags: {' '.join(have)}"


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
    return parse_cpuinfo(text, usable_cores())

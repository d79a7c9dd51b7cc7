"""A C kernel built for plain x86-64 (no AVX2): the loops an ARM or older x86 CPU compiles."""
from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import pytest

from tandem.kernels.native import build as native_build

x86_only = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the SIMD path is x86's AVX2"
)


def portable_build(source: Path, out_dir: Path) -> ctypes.CDLL:
    lib = out_dir / f"{source.stem}-portable.so"
    subprocess.run(
        [
            native_build.find_compiler(),
            "-O2",
            "-march=x86-64",
            "-fno-math-errno",
            "-shared",
            "-fPIC",
            "-o",
            str(lib),
            str(source),
            "-lm",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return ctypes.CDLL(str(lib))


def march_build(source: Path, out_dir: Path, march: str) -> ctypes.CDLL:
    """`source` built as kernels/native/build.py builds it, for -march=`march` instead of this CPU (a
    narrower x86 target runs here too: its SIMD path is the one such a CPU compiles)."""
    lib = out_dir / f"{source.stem}-{march}.so"
    flags = [f if f != "-march=native" else f"-march={march}" for f in native_build.FLAGS]
    subprocess.run(
        [native_build.find_compiler(), *flags, *native_build.OPENMP, "-o", str(lib), str(source), "-lm"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return ctypes.CDLL(str(lib))

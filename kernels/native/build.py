"""Compile one of kernels/csrc/*.c into a shared library on first use, and load it with ctypes.

The CPU kernels are plain C (no torch headers, so each builds in about a second) compiled with the
system's C compiler for this very CPU (`-march=native`, or the class TANDEM_CPU_ISA names: cpu_caps.py),
cached in ~/.cache/tandem/kernels (or $TANDEM_KERNEL_CACHE) under a hash of the source, compiler, flags
and CPU. With OpenMP they run on the threads of the runtime torch itself loaded (the library names
libgomp.so.1, which the loader resolves to the copy already in the process).
Whether they run at all is kernels/ops.py's choice.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tandem.kernels.native.cpu_caps import cpu_caps

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")
# Tried first; a compiler without OpenMP builds the kernel single-threaded.
OPENMP = ("-fopenmp",)


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "tandem",
        "kernels",
    )
    return Path(root)


def _this_cpu() -> str:
    caps = cpu_caps()
    return caps.model + " " + " ".join(sorted(caps.flags))


def find_compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(source: Path, compiler: str | None = None) -> Path:
    """Compile `source` (or find it already compiled) and return the shared library's path.
    Raises RuntimeError with the compiler's message when there is no compiler or it fails."""
    cc = compiler or find_compiler()
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    # -march=native: the library is only valid on this CPU, so its flags are part of the name.
    # The headers beside the source, and the .c files it #includes (moe.c builds on quant_linear.c's
    # tiles), are part of what is built.
    included = re.findall(r'^#include "([\w.]+\.c)"', source.read_text(), re.MULTILINE)
    headers = [
        h.read_bytes() for h in [*sorted(source.parent.glob("*.h")), *(source.parent / c for c in included)]
    ]
    flags = [f"-march={cpu_caps().march}" if f == "-march=native" else f for f in FLAGS]
    key = hashlib.sha256(
        b"\0".join(
            [source.read_bytes(), *headers, cc.encode(), " ".join(flags).encode(), _this_cpu().encode()]
        )
    ).hexdigest()[:16]
    out_dir = cache_dir()
    lib = out_dir / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        errors = []
        for extra in (OPENMP, ()):
            proc = subprocess.run(
                [cc, *flags, *extra, "-o", tmp, str(source), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode == 0:
                os.replace(tmp, lib)
                return lib
            errors.append(proc.stderr.strip()[-1000:])
        raise RuntimeError(f"{cc} failed: {errors[-1]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path, what: str) -> ctypes.CDLL | None:
    """The built library, or None (logged once per caller, which caches the answer) when the build fails;
    `what` says in the log what runs instead."""
    try:
        return ctypes.CDLL(str(build(source)))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        log.warning("%s unavailable, %s: %s", source.name, what, e)
        return None

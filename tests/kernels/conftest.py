"""The kernel tests run the Triton kernels interpreted on CPU tensors, but only on a machine without a GPU:
set here, before any kernel is jitted, and never where tests/kernels/test_gpu.py runs them natively (it
asserts the interpreter is off). There the tests that need the interpreter are skipped (ops_variants.py's
`cpu_triton`): their twins in test_gpu.py run the same kernels on the device."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.gguf_files import write_gguf

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def gguf_model(tiny_model, tmp_path_factory):  # a factory: the step-graph tests' GGUF files
    root = tmp_path_factory.mktemp("graph-gguf")

    def get(arch: str, qtype: str = "Q4_1") -> Path:
        out = root / f"{arch}-{qtype}.gguf"
        if not out.exists():  # K-quant blocks are 256 weights: the "small" model has whole ones
            write_gguf(tiny_model(arch, size="small" if "K" in qtype else "tiny"), out, qtype)
        return out

    return get

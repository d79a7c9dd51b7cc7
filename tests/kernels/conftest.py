"""The kernel tests run the Triton kernels interpreted on CPU tensors, but only on a machine without a GPU:
set here, before any kernel is jitted, and never where tests/kernels/test_gpu.py runs them natively (it
asserts the interpreter is off). There the tests that need the interpreter are skipped (ops_variants.py's
`cpu_triton`): their twins in test_gpu.py run the same kernels on the device."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

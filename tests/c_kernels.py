"""The engine's C kernels must build wherever the tests run: a test that needs them fails, and never skips,
when there is no compiler or a build fails (the engine itself would log it and decode eagerly)."""

from __future__ import annotations

import pytest

from tandem.kernels.native import (
    argmax,
    moe,
    norm_act,
    paged_attention,
    quant_bf16,
    quant_linear,
    quant_repack,
    rotary,
    step_graph,
)
from tandem.kernels.native import build as native_build

KERNELS = (norm_act, rotary, paged_attention, quant_linear, quant_bf16, quant_repack, moe, argmax, step_graph)


def check_built() -> None:
    """Builds every kernel (or finds it built) and loads it; pytest.fail with the compiler's message."""
    for kernel in KERNELS:
        try:
            native_build.build(kernel.SOURCE)
        except Exception as e:  # the compiler's message, whatever went wrong
            pytest.fail(f"the C kernel {kernel.SOURCE.name} does not build: {e}", pytrace=False)
        if not kernel.available():
            pytest.fail(f"{kernel.__name__} built but does not load (see the log)", pytrace=False)


# A test (or module: pytestmark) that runs the C kernels.
needs_c_kernels = pytest.mark.usefixtures("c_kernels")

"""Every `Ops` kernels/ops.py's resolve_ops can return on this machine, for the kernel tests to run each op
through all of its implementations."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tandem.kernels.ops import Ops, resolve_ops

# The switches resolve_ops reads, in every combination that can pick another implementation.
_SWITCHES = {
    "default": {},
    "no-native": {"TANDEM_NO_NATIVE": "1"},
    "torch": {"TANDEM_TRITON": "0", "TANDEM_NO_NATIVE": "1"},
    "triton": {"TANDEM_TRITON": "1"},
}


@contextmanager
def switches(env: dict[str, str]) -> Iterator[None]:
    """resolve_ops's environment set to `env` alone (its two switches otherwise unset)."""
    saved = {k: os.environ.pop(k, None) for k in ("TANDEM_TRITON", "TANDEM_NO_NATIVE")}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def triton_runs(device: torch.device) -> bool:
    """Triton kernels run on `device`'s tensors: natively on CUDA, interpreted on CPU
    (tests/kernels/conftest)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# A test that runs Triton kernels on CPU tensors: only under the interpreter (machines without a GPU).
cpu_triton = pytest.mark.skipif(
    not triton_runs(torch.device("cpu")),
    reason="Triton runs natively here (tests/kernels/test_gpu.py), not interpreted",
)


def ops_variants(
    device: str = "cpu", dtype: torch.dtype = torch.float32, attention: str = "auto"
) -> list[Ops]:
    """The distinct Ops resolve_ops returns here for device and dtype, in the order of _SWITCHES."""
    dev = torch.device(device)
    found: list[Ops] = []
    for name, env in _SWITCHES.items():
        if name == "triton" and not triton_runs(dev):
            continue
        with switches(env):
            ops = resolve_ops(dev, dtype, attention)
        if ops not in found:
            found.append(ops)
    return found


def ops_params(device: str = "cpu", dtype: torch.dtype = torch.float32, attention: str = "auto") -> list:
    """ops_variants as pytest params, each named by what it picked."""
    return [pytest.param(o, id=f"{o.attention}-{'native' if o.native else 'torch'}-"
                               f"{'host' if o.host_drafts else 'triton'}")
            for o in ops_variants(device, dtype, attention)]

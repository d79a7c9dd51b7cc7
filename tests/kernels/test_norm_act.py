"""The C RMSNorm / SiLU-and-multiply (kernels/csrc/norm_act.c) against their torch references, row
invariance, the in-place residual add, and what they refuse; every implementation resolve_ops picks here
against the references."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native import norm_act as cpu_norm_act
from tandem.kernels.native.norm_act import add_rms_norm, gelu_mul, silu_mul
from tandem.kernels.ops import Ops, resolve_ops
from tandem.kernels.reference.norm_act import gelu_mul_ref, rms_norm_ref, silu_mul_ref
from tests.c_kernels import needs_c_kernels
from tests.kernels.ops_variants import ops_params
from tests.kernels.portable_build import portable_build, x86_only

pytestmark = needs_c_kernels


@pytest.mark.parametrize("n", [20, 64, 576, 1536])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_rms_norm_and_residual_add_match_the_reference(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g) * 3
    delta = torch.randn(rows, n, generator=g)
    w = torch.randn(n, generator=g)
    torch.testing.assert_close(add_rms_norm(x, None, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    h = x.clone()
    got = add_rms_norm(h, delta, w, 1e-6)
    assert torch.equal(h, x + delta)  # the residual stream took the layer's output, in place
    torch.testing.assert_close(got, rms_norm_ref(x + delta, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [7, 64, 1536])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_silu_mul_matches_the_reference(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows + n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 0.0, 100.0])  # exp's clamps: silu ~ 0, 0 and x
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up.clone()), atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("n", [7, 64, 1536])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_gelu_mul_matches_the_reference(rows: int, n: int) -> None:
    """Gemma's GeGLU: gelu (tanh form, HF's gelu_pytorch_tanh) of the gate times up."""
    g = torch.Generator().manual_seed(rows * 3 + n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 0.0, 100.0])  # exp's clamps: gelu ~ 0, 0 and x
    torch.testing.assert_close(gelu_mul(gate_up), gelu_mul_ref(gate_up.clone()), atol=2e-6, rtol=4e-6)
    assert torch.equal(gelu_mul(gate_up[-1:]), gelu_mul(gate_up)[-1:])  # a row alone: the same bits


def test_a_row_is_the_same_alone_in_a_batch_strided_and_on_more_threads() -> None:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(400, 1000, generator=g)
    x = big[:, :576]  # rows 1,000 floats apart
    w = torch.randn(576, generator=g)
    batch = add_rms_norm(x, None, w, 1e-5)
    alone = add_rms_norm(x[123:124].contiguous(), None, w, 1e-5)
    assert torch.equal(batch[123], alone[0])
    gate_up = torch.randn(400, 3072, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = silu_mul(gate_up), add_rms_norm(x, None, w, 1e-5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], silu_mul(gate_up)) and torch.equal(one[1], batch)
    assert torch.equal(silu_mul(gate_up[7:8]), silu_mul(gate_up)[7:8])


def test_refuses_what_it_does_not_handle() -> None:
    w = torch.ones(8)
    with pytest.raises(ValueError, match="float32"):
        add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), None, w, 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), w, 1e-5)
    with pytest.raises(ValueError):
        silu_mul(torch.ones(2, 7))
    with pytest.raises(ValueError):
        silu_mul(torch.ones(2, 8)[:, ::2])
    with pytest.raises(ValueError, match="gelu_mul"):
        gelu_mul(torch.ones(2, 7))


@x86_only
def test_portable_build_matches_the_reference(tmp_path, monkeypatch) -> None:
    lib = portable_build(cpu_norm_act.SOURCE, tmp_path)
    monkeypatch.setattr(native_build, "load", lambda source, what: lib)
    cpu_norm_act._library.cache_clear()
    try:
        test_rms_norm_and_residual_add_match_the_reference(3, 576)
        test_silu_mul_matches_the_reference(5, 64)
        test_gelu_mul_matches_the_reference(5, 64)
    finally:
        cpu_norm_act._library.cache_clear()


def test_layers_use_the_kernels_on_cpu_float32_and_torch_otherwise() -> None:
    from tandem.worker.layers import RMSNorm

    norm = RMSNorm(64, 1e-5, torch.float32, "cpu", resolve_ops("cpu", torch.float32))
    norm.weight.data.normal_()
    x = torch.randn(4, 64)
    assert torch.equal(norm(x), add_rms_norm(x, None, norm.weight, 1e-5))
    bf = RMSNorm(64, 1e-5, torch.bfloat16, "cpu", resolve_ops("cpu", torch.bfloat16))
    xb = x.bfloat16()
    assert torch.equal(bf(xb), rms_norm_ref(xb, bf.weight, 1e-5))
    h, d = x.clone(), torch.randn(4, 64)
    assert torch.equal(norm.add_forward(h, d), add_rms_norm(x + d, None, norm.weight, 1e-5))


@pytest.mark.parametrize("ops", ops_params())
def test_every_implementation_matches_the_reference(ops: Ops) -> None:
    """What the layers call, each way resolve_ops can pick it here; [T, heads, D] views (Qwen3's q/k norms)
    included, which the C pass does not take."""
    g = torch.Generator().manual_seed(7)
    x, delta, w = (
        torch.randn(6, 64, generator=g),
        torch.randn(6, 64, generator=g),
        torch.randn(64, generator=g),
    )
    tol = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(ops.add_rms_norm(x, None, w, 1e-5), rms_norm_ref(x, w, 1e-5), **tol)
    h = x.clone()
    torch.testing.assert_close(ops.add_rms_norm(h, delta, w, 1e-5), rms_norm_ref(x + delta, w, 1e-5), **tol)
    assert torch.equal(h, x + delta)
    heads = torch.randn(6, 3 * 16 + 5, generator=g)[:, :48].view(6, 3, 16)
    w16 = w[:16].contiguous()
    torch.testing.assert_close(
        ops.add_rms_norm(heads, None, w16, 1e-5), rms_norm_ref(heads, w16, 1e-5), **tol
    )
    gate_up = torch.randn(6, 128, generator=g)
    torch.testing.assert_close(
        ops.silu_mul(gate_up.clone()), silu_mul_ref(gate_up.clone()), atol=1e-6, rtol=2e-6
    )
    torch.testing.assert_close(ops.gelu_mul(gate_up.clone()), gelu_mul_ref(gate_up), atol=2e-6, rtol=4e-6)

"""The C rotary kernel (kernels/csrc/rotary.c) against torch's ops: the same bits, on any rows, strides and
threads, through the portable loops too; and every implementation resolve_ops picks here."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.native import rotary as cpu_rotary
from tandem.kernels.ops import Ops, resolve_ops
from tandem.kernels.reference.rotary import apply_rotary_ref
from tandem.worker.layers.rotary import RotaryEmbedding
from tests.kernels.ops_variants import ops_params
from tests.kernels.portable_build import portable_build, x86_only
from tests.kernels.test_cpu_paged_attention import needs_cc


def _case(t: int, heads: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k rotated together as the model does: a strided view into a fused qkv row."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2) * d + 3, generator=g) * 10
    x = qkv[:, : heads * d].view(t, heads, d)
    rot = RotaryEmbedding(d, 10000.0, {}, torch.float32, "cpu")
    cos, sin = rot.cos_sin(torch.randint(0, 5000, (t,), generator=g), 5000)
    return x, cos, sin


@needs_cc
@pytest.mark.parametrize("d", [64, 128, 20, 2])  # 20, 2: halves not a multiple of 8 (the scalar loop)
@pytest.mark.parametrize("t", [1, 7, 300])  # 300 x 12 heads: split over threads
def test_same_bits_as_torch(t: int, d: int) -> None:
    x, cos, sin = _case(t, 12, d, seed=t + d)
    want = apply_rotary_ref(x, cos, sin)
    got = cpu_rotary.rotary(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, want)
    # What the model calls on CPU in float32 is the kernel.
    assert torch.equal(resolve_ops("cpu", torch.float32).rotary(x, cos, sin), want)


@needs_cc
def test_a_row_is_the_same_alone_and_on_any_threads(monkeypatch) -> None:
    x, cos, sin = _case(300, 12, 64, seed=1)
    many = cpu_rotary.rotary(x, cos, sin)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(many, cpu_rotary.rotary(x, cos, sin))
    assert torch.equal(many[5:6], cpu_rotary.rotary(x[5:6], cos[5:6], sin[5:6]))


@needs_cc
@x86_only
def test_portable_build_gives_the_same_bits(tmp_path, monkeypatch) -> None:
    lib = cpu_rotary.bind(portable_build(cpu_rotary.SOURCE, tmp_path))
    monkeypatch.setattr(cpu_rotary, "_library", lambda: lib)
    for d in (64, 20):
        x, cos, sin = _case(9, 4, d, seed=d)
        assert torch.equal(cpu_rotary.rotary(x, cos, sin), apply_rotary_ref(x, cos, sin))


def test_other_dtypes_and_no_kernel_take_the_torch_ops(monkeypatch) -> None:
    x, cos, sin = _case(3, 2, 16, seed=0)
    xb, cb, sb = x.bfloat16(), cos.bfloat16(), sin.bfloat16()
    assert not cpu_rotary.supports(xb, cb)
    assert resolve_ops("cpu", torch.bfloat16).rotary is apply_rotary_ref
    with pytest.raises(ValueError, match="float32"):
        cpu_rotary.rotary(xb, cb, sb)
    monkeypatch.setattr(cpu_rotary, "_library", lambda: None)
    assert not cpu_rotary.supports(x, cos)
    assert resolve_ops("cpu", torch.float32).rotary is apply_rotary_ref
    monkeypatch.undo()
    monkeypatch.setenv("TANDEM_NO_NATIVE", "1")
    assert resolve_ops("cpu", torch.float32).rotary is apply_rotary_ref


@pytest.mark.parametrize("ops", ops_params())
def test_every_implementation_gives_the_reference_bits(ops: Ops) -> None:
    x, cos, sin = _case(7, 5, 64, seed=3)
    assert torch.equal(ops.rotary(x, cos, sin), apply_rotary_ref(x, cos, sin))

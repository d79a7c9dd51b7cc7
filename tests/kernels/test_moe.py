"""The MoE kernels against kernels/reference/moe.py: the C layer (routing, and the experts over float32 panels
and over GGUF blocks of every kind, mixed between gate/up and down), a token's result alone and in a batch
and on any thread count, the portable build; the Triton grouped product (interpreted on CPU) and the pair
sorting it works from; the Ops' choice."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native import moe as cpu_moe
from tandem.kernels.native.cpu_caps import cpu_caps
from tandem.kernels.native.quant_pack import pack
from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.moe import experts_ref, route_ref, sort_by_expert
from tandem.kernels.triton.moe import experts_triton
from tests.c_kernels import needs_c_kernels
from tests.gguf_files import K_QUANTS, QTYPES, k_quant_blocks
from tests.kernels.ops_variants import cpu_triton, switches
from tests.kernels.portable_build import march_build, portable_build, x86_only

needs_cc = needs_c_kernels


def _layer(t: int, e: int, h: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    router = torch.randn(e, h, generator=g) / h**0.5 * 3
    return x, w13, w2, router


# (tokens, experts, top-k, hidden, intermediate): decode rows, a prefill chunk past the kernel's 512-token
# pass, every expert taken (k = E), intermediate sizes off the 16-column panels
SHAPES = [(1, 8, 2, 64, 32), (5, 8, 8, 64, 48), (40, 4, 1, 48, 24), (33, 16, 2, 64, 40), (600, 8, 2, 128, 72)]


@needs_cc
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize(("t", "e", "k", "h", "inter"), SHAPES)
def test_cpu_layer_routes_and_sums_like_the_reference(t: int, e: int, k: int, h: int, inter: int,
                                                      renorm: bool) -> None:
    x, w13, w2, router = _layer(t, e, h, inter, seed=t + e)
    weights, ids = route_ref(x @ router.T, k, renorm)
    y, got_w, got_ids = cpu_moe.moe(x, cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), k, renorm,
                                    router=cpu_moe.pack_router(router))
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_w, weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y, experts_ref(x, w13, w2, weights, ids), atol=2e-5, rtol=1e-5)


@needs_cc
def test_a_token_is_the_same_alone_in_a_batch_and_on_one_thread() -> None:
    x, w13, w2, router = _layer(70, 8, 64, 48, seed=3)
    args = (cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), 2, True)
    r = cpu_moe.pack_router(router)
    batch = cpu_moe.moe(x, *args, router=r)[0]
    alone = cpu_moe.moe(x[41:42].clone(), *args, router=r)[0]
    assert torch.equal(alone[0], batch[41])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_moe.moe(x, *args, router=r)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, batch)


def _blocks(qtype: str, w: torch.Tensor, seed: int) -> list:
    """Each expert of [E, N, K] as the kernel's layout of a GGUF tensor of `qtype` (K-quants: random
    blocks)."""
    out = []
    for e, m in enumerate(w.numpy()):
        if qtype in K_QUANTS:
            raw = k_quant_blocks(qtype, *m.shape, seed=seed + e)
        else:
            raw = gguf.quants.quantize(m, QTYPES[qtype])
        out.append(pack(raw, qtype, m.shape[1]))
    return out


@needs_cc
@pytest.mark.parametrize(
    ("q13", "q2"),
    [
        ("Q8_0", "Q8_0"),
        ("Q4_0", "Q4_1"),
        ("Q5_0", "Q5_1"),
        ("Q4_K", "Q6_K"),
        ("Q5_K", "F32"),
        ("F32", "Q8_0"),
    ],
)
@pytest.mark.parametrize("t", [1, 3, 24])
def test_cpu_experts_from_gguf_blocks(q13: str, q2: str, t: int) -> None:
    """The experts from quantized blocks compute with gguf's dequantized weights (few rows: the direct
    tiles; 16 and more: the scratch path), one matrix's type independent of the other's."""
    x, w13, w2, _ = _layer(t, 4, 256, 256, seed=7)
    p13 = cpu_moe.pack_experts(w13 if q13 == "F32" else _blocks(q13, w13, 1))
    p2 = cpu_moe.pack_experts(w2 if q2 == "F32" else _blocks(q2, w2, 2))
    weights, ids = route_ref(torch.randn(t, 4, generator=torch.Generator().manual_seed(t)), 2, False)
    y = cpu_moe.moe(x, p13, p2, 2, weights=weights, ids=ids)[0]
    ref = experts_ref(x, p13.dequantize(), p2.dequantize(), weights, ids)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    if q13 not in ("F32", *K_QUANTS):  # (the K-quants' blocks are random, not w13's)
        raw = gguf.quants.quantize(w13[1].numpy(), QTYPES[q13])
        assert torch.equal(p13.dequantize()[1], torch.from_numpy(gguf.quants.dequantize(raw, QTYPES[q13])))


@needs_cc
def test_cpu_layer_refuses_what_it_does_not_take() -> None:
    x, w13, w2, router = _layer(3, 4, 64, 32, seed=1)
    p13, p2 = cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2)
    with pytest.raises(ValueError, match="float32"):
        cpu_moe.moe(x.bfloat16(), p13, p2, 2, router=cpu_moe.pack_router(router))
    with pytest.raises(ValueError, match="top_k 5 of 4"):
        cpu_moe.moe(x, p13, p2, 5, router=cpu_moe.pack_router(router))
    with pytest.raises(ValueError, match="ids below 4"):
        cpu_moe.moe(x, p13, p2, 2, weights=torch.ones(3, 2), ids=torch.tensor([[0, 1], [2, 4], [0, 0]]))
    with pytest.raises(ValueError, match="SwiGLU"):
        cpu_moe.moe(x, p13, cpu_moe.pack_experts(w2[:, :, :16]), 2, router=cpu_moe.pack_router(router))
    with pytest.raises(ValueError, match="differ"):
        cpu_moe.pack_experts(_blocks("Q8_0", w2[:1], 0) + _blocks("Q4_0", w2[1:2], 0))


@needs_cc
@x86_only
def test_portable_build_matches_the_reference(tmp_path, monkeypatch) -> None:
    lib = portable_build(cpu_moe.SOURCE, tmp_path)
    monkeypatch.setattr(native_build, "load", lambda source, what: lib)
    cpu_moe._library.cache_clear()
    try:
        x, w13, w2, router = _layer(20, 8, 256, 48, seed=5)
        weights, ids = route_ref(x @ router.T, 2, True)
        p13 = cpu_moe.pack_experts(_blocks("Q4_K", w13, 3))
        y, _, got_ids = cpu_moe.moe(
            x, p13, cpu_moe.pack_experts(w2), 2, True, router=cpu_moe.pack_router(router)
        )
        assert torch.equal(got_ids, ids)
        torch.testing.assert_close(
            y, experts_ref(x, p13.dequantize(), w2, weights, ids), atol=1e-4, rtol=1e-4
        )
    finally:
        cpu_moe._library.cache_clear()


@needs_cc
@x86_only
@pytest.mark.slow  # a second build of the MoE kernel (~9 s): the fast tier tests this CPU's own build
@pytest.mark.skipif("avx2" not in cpu_caps().flags, reason="the AVX2 build runs on an AVX2 CPU only")
def test_the_avx2_and_avx512_float32_tiles_give_the_same_bits(tmp_path, monkeypatch) -> None:
    """-march=haswell builds the AVX2 tiles, this CPU's build the AVX-512 ones where it has them: each output
    one FMA chain in k order either way, so the same bits at every row count."""
    x, w13, w2, router = _layer(600, 8, 64, 80, seed=9)
    p13, p2, r = cpu_moe.pack_experts(w13), cpu_moe.pack_experts(w2), cpu_moe.pack_router(router)
    native = {t: cpu_moe.moe(x[:t], p13, p2, 2, True, router=r)[0] for t in (1, 3, 8, 20, 130, 600)}
    lib = march_build(cpu_moe.SOURCE, tmp_path, "haswell")
    monkeypatch.setattr(native_build, "load", lambda source, what: lib)
    cpu_moe._library.cache_clear()
    try:
        for t, want in native.items():
            assert torch.equal(cpu_moe.moe(x[:t], p13, p2, 2, True, router=r)[0], want), t
    finally:
        cpu_moe._library.cache_clear()


@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (7, 8, 8), (40, 4, 1), (0, 4, 2), (100, 64, 4)])
def test_pairs_sorted_by_expert_in_whole_blocks(t: int, e: int, k: int) -> None:
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(i))[:k] for i in range(t)]) \
        if t else torch.zeros(0, k, dtype=torch.int64)
    pair_ids, block_expert = sort_by_expert(ids, e, 16)
    assert pair_ids.numel() == block_expert.numel() * 16
    flat = ids.reshape(-1)
    real = pair_ids[pair_ids < t * k]
    assert sorted(real.tolist()) == list(range(t * k))  # every pair once
    blocks = pair_ids.view(-1, 16)
    for b, ex in enumerate(block_expert.tolist()):
        mine = blocks[b][blocks[b] < t * k]
        if ex < 0:
            assert mine.numel() == 0
        else:
            assert mine.numel() > 0 and bool((flat[mine] == ex).all())
            assert mine.tolist() == sorted(mine.tolist())  # token order within an expert
    assert (block_expert >= 0).sum() == sum(-(-int((flat == x).sum()) // 16) for x in range(e))


# float16, not bfloat16: Triton 3.9's interpreter loads bfloat16 as garbage (a plain copy kernel does too);
# tests/kernels/test_gpu.py runs bfloat16 natively.
@cpu_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("t", "e", "k", "h", "inter"),
    [(1, 8, 2, 64, 32), (7, 8, 8, 64, 48), (40, 4, 1, 48, 24), (0, 4, 2, 32, 16)],
)
def test_triton_experts_equal_the_reference(
    t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype
) -> None:
    x, w13, w2, router = _layer(t, e, h, inter, seed=11 + t)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    weights, ids = route_ref(x.float() @ router.T, k, True)
    got = experts_triton(x, w13, w2, weights, ids)
    ref = experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@cpu_triton
def test_ops_pick_the_triton_experts_when_triton_runs() -> None:
    with switches({"TANDEM_TRITON": "1"}):
        assert resolve_ops("cpu", torch.float32).moe_experts is experts_triton
    with switches({"TANDEM_TRITON": "0"}):
        assert resolve_ops("cpu", torch.float32).moe_experts is experts_ref


def test_route_ref_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route_ref(logits, 2, False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, p[:, :2])
    w, _ = route_ref(logits, 2, True)
    assert torch.allclose(w.sum(-1), torch.ones(1)) and torch.allclose(w, p[:, :2] / p[:, :2].sum())
    np.testing.assert_allclose(route_ref(logits, 4, True)[0].sum().item(), 1.0, rtol=1e-6)

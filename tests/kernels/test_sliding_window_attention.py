"""Sliding-window attention (a query at position p sees keys p-W+1 .. p) in every implementation: the torch
reference against dense attention, the C kernel and the Triton kernel (interpreted on CPU) against both;
none reads a slot before a query's window (those table entries are poisoned here), a pool of the sliding
layers' own is read through its slot map, and the C kernel's bits do not depend on how a prompt is split."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.kernels.native import build as native_build
from tandem.kernels.native.paged_attention import paged_attention, paged_attention_cpu, plan_cpu_attention
from tandem.kernels.reference.paged_attention import build_attention_plan, paged_attention_ref
from tests.c_kernels import needs_c_kernels
from tests.kernels.ops_variants import cpu_triton
from tests.kernels.test_paged_attention import NUM_SLOTS, make_case

needs_cc = needs_c_kernels

CASES = {
    "mixed": [(30, 1), (25, 25), (140, 1), (60, 17), (3, 1), (9, 9), (75, 1), (41, 40), (2, 1)],
    "verify": [(30, 5), (140, 5), (12, 5), (40, 1), (7, 3), (60, 5), (5, 5), (90, 17), (9, 3)],
    "long-prefills": [(100, 100), (70, 64), (150, 1)],
    "decodes-equal": [(50, 1), (50, 1), (50, 1)],
}
WINDOWS = [1, 7, 16, 40]


def naive(q, k_pool, v_pool, slot_lists, seq_lens, extend_lens, scale, window):
    """Dense attention per request, causal and windowed by absolute position, in float64."""
    group = q.shape[1] // k_pool.shape[1]
    outs, t = [], 0
    for slots, s, e in zip(slot_lists, seq_lens, extend_lens, strict=True):
        k = k_pool[slots].repeat_interleave(group, dim=1).double()
        v = v_pool[slots].repeat_interleave(group, dim=1).double()
        scores = torch.einsum("ehd,shd->hes", q[t : t + e].double(), k) * scale
        pos, key = torch.arange(s - e, s)[:, None], torch.arange(s)[None, :]
        scores = scores.masked_fill((key > pos) | (key <= pos - window), float("-inf"))
        outs.append(torch.einsum("hes,shd->ehd", scores.softmax(-1), v))
        t += e
    return torch.cat(outs).float()


def windowed_case(reqs: list[tuple[int, int]], window: int, group: int, seed: int, d: int = 16) -> dict:
    """make_case with each request's table entries before its first query's window set to -1: an
    implementation that reads one fails (index error, or a C kernel reading far outside its pool)."""
    c = make_case(reqs, hkv=2, group=group, seed=seed, d=d)
    for row, (s, e) in zip(c["req_pool_indices"].tolist(), reqs, strict=True):
        c["req_to_token"][row, : max(0, s - e - window + 1)] = -1
    c["dense"] = naive(c["q"], c["k_pool"], c["v_pool"], c["slot_lists"], [s for s, _ in reqs],
                       [e for _, e in reqs], c["scale"], window)
    return c


def _ref(c: dict, window: int, **kw) -> torch.Tensor:
    return paged_attention_ref(c["q"], c["k_pool"], c["v_pool"], c["req_to_token"], c["req_pool_indices"],
                               c["seq_lens"], c["extend_lens"], c["scale"], window=window, **kw)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_dense(case: str, group: int, window: int) -> None:
    c = windowed_case(CASES[case], window, group, seed=window + group)
    torch.testing.assert_close(_ref(c, window), c["dense"], atol=2e-5, rtol=1e-5)
    # a plan from host lists (the model's path), the fresh prefills attending their own K/V as computed
    plan = build_attention_plan(c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["extend_lens"],
                                seq_lens_cpu=c["seq_lens"].tolist(), window=window)
    fresh = [s == e for s, e in CASES[case]]
    new_k = torch.cat(
        [c["k_pool"][sl[s - e :]] for sl, (s, e) in zip(c["slot_lists"], CASES[case], strict=True)]
    )
    new_v = torch.cat(
        [c["v_pool"][sl[s - e :]] for sl, (s, e) in zip(c["slot_lists"], CASES[case], strict=True)]
    )
    got = _ref(c, window, plan=plan, new_kv=(new_k, new_v) if any(fresh) else None)
    torch.testing.assert_close(got, c["dense"], atol=2e-5, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize("d", [16, 20])  # 20: the portable loops
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_c_kernel_matches_dense(case: str, window: int, d: int) -> None:
    c = windowed_case(CASES[case], window, group=2, seed=window * d, d=d)
    plan = plan_cpu_attention(c["req_to_token"], c["req_pool_indices"].tolist(), c["seq_lens"].tolist(),
                              c["extend_lens"].tolist(), window=window)
    got = paged_attention_cpu(c["q"], c["k_pool"], c["v_pool"], plan, c["scale"])
    torch.testing.assert_close(got, c["dense"], atol=2e-5, rtol=1e-5)


@needs_cc
@pytest.mark.parametrize("d", [16, 20])
@pytest.mark.parametrize("window", [5, 8, 17])
def test_c_kernel_gives_a_prompt_the_same_bits_whole_chunked_or_token_by_token(window: int, d: int) -> None:
    g = torch.Generator().manual_seed(window + d)
    n = 70
    kp, vp = torch.randn(200, 2, d, generator=g), torch.randn(200, 2, d, generator=g)
    slots = torch.randperm(200, generator=g)[:n][None].clone()
    q = torch.randn(n, 4, d, generator=g)

    def attend(a: int, b: int) -> torch.Tensor:
        return paged_attention(q[a:b], kp, vp, slots, torch.tensor([b]), [b - a], 0.3, window=window)

    whole = attend(0, n)
    assert torch.equal(whole, torch.cat([attend(a, b) for a, b in ((0, 9), (9, 30), (30, 31), (31, n))]))
    assert torch.equal(whole, torch.cat([attend(t, t + 1) for t in range(n)]))


def _split_pool(c: dict, window: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool of the sliding layers' own, holding only the keys some window reaches, at other slots, and the
    map from the table's slots to them (0 elsewhere): what the worker gives a sliding layer."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_SLOTS, *c["k_pool"].shape[1:], generator=g)  # garbage where nothing maps
    v = torch.randn(NUM_SLOTS, *c["v_pool"].shape[1:], generator=g)
    slot_map = torch.zeros(NUM_SLOTS, dtype=torch.int64)
    free = (torch.randperm(NUM_SLOTS - 1, generator=g) + 1).tolist()
    for sl, s, e in zip(c["slot_lists"], c["seq_lens"].tolist(), c["extend_lens"].tolist(), strict=True):
        for full in sl[max(0, s - e - window + 1):].tolist():
            slot_map[full] = mine = free.pop()
            k[mine], v[mine] = c["k_pool"][full], c["v_pool"][full]
    return k, v, slot_map


@pytest.mark.parametrize("window", [3, 16])
def test_a_pool_of_its_own_read_through_the_slot_map(window: int) -> None:
    c = windowed_case(CASES["mixed"], window, group=2, seed=window)
    c["req_to_token"] = c["req_to_token"].clamp(min=0)  # the map's entry for a slot no window reaches is 0
    k, v, slot_map = _split_pool(c, window, seed=window)
    got = paged_attention_ref(c["q"], k, v, c["req_to_token"], c["req_pool_indices"], c["seq_lens"],
                              c["extend_lens"], c["scale"], window=window, slot_map=slot_map)
    torch.testing.assert_close(got, c["dense"], atol=2e-5, rtol=1e-5)
    if native_build.find_compiler() is not None:
        plan = plan_cpu_attention(c["req_to_token"], c["req_pool_indices"].tolist(), c["seq_lens"].tolist(),
                                  c["extend_lens"].tolist(), window=window, slot_map=slot_map)
        torch.testing.assert_close(paged_attention_cpu(c["q"], k, v, plan, c["scale"]), c["dense"],
                                   atol=2e-5, rtol=1e-5)


@cpu_triton
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("window", [3, 40])
@pytest.mark.parametrize("case", ["mixed", "decodes-equal"])
def test_triton_matches_the_reference(case: str, window: int, mapped: bool) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    from tandem.kernels.triton.paged_attention import paged_attention_triton

    c = windowed_case(CASES[case], window, group=2, seed=window + mapped)
    k, v, slot_map = c["k_pool"], c["v_pool"], None
    if mapped:
        c["req_to_token"] = c["req_to_token"].clamp(min=0)
        k, v, slot_map = _split_pool(c, window, seed=window)
    ext = c["extend_lens"]
    got = paged_attention_triton(
        c["q"], k, v, c["req_to_token"], c["req_pool_indices"], c["seq_lens"], ext, c["scale"],
        cu_lens=torch.cumsum(ext, 0) - ext, max_extend=int(ext.max()), window=window, slot_map=slot_map,
    )
    torch.testing.assert_close(got, c["dense"], atol=2e-5, rtol=1e-4)

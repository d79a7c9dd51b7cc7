"""paged_attention_ref against naive dense attention computed request by request."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.reference.paged_attention import build_attention_plan, paged_attention_ref

D = 16
NUM_SLOTS = 1024
MAX_REQS = 12
MAX_CTX = 160


def naive(q, k_pool, v_pool, slot_lists, seq_lens, extend_lens, scale):
    """Dense attention per request: repeat K/V per query head, causal by absolute position."""
    hkv = k_pool.shape[1]
    group = q.shape[1] // hkv
    outs, t = [], 0
    for slots, s, e in zip(slot_lists, seq_lens, extend_lens, strict=True):
        k = k_pool[slots].repeat_interleave(group, dim=1).double()  # [S, H, D]
        v = v_pool[slots].repeat_interleave(group, dim=1).double()
        qi = q[t : t + e].double()  # [E, H, D]
        scores = torch.einsum("ehd,shd->hes", qi, k) * scale
        pos = torch.arange(s - e, s)
        scores = scores.masked_fill(torch.arange(s)[None, :] > pos[:, None], float("-inf"))
        outs.append(torch.einsum("hes,shd->ehd", scores.softmax(-1), v))
        t += e
    return torch.cat(outs).float()


def make_case(reqs: list[tuple[int, int]], hkv: int, group: int, seed: int, d: int = D) -> dict:
    """reqs: (seq_len, extend_len) per request, in batch order. Random pools, rows and slots."""
    g = torch.Generator().manual_seed(seed)
    h = hkv * group
    k_pool = torch.randn(NUM_SLOTS, hkv, d, generator=g)
    v_pool = torch.randn(NUM_SLOTS, hkv, d, generator=g)
    # Stale entries past each request's length must never be read: fill them with invalid slots.
    req_to_token = torch.full((MAX_REQS, MAX_CTX), -1, dtype=torch.int64)
    rows = torch.randperm(MAX_REQS, generator=g)[: len(reqs)]
    free = torch.randperm(NUM_SLOTS, generator=g)
    slot_lists, used = [], 0
    for row, (s, _) in zip(rows.tolist(), reqs, strict=True):
        slots = free[used : used + s]
        used += s
        req_to_token[row, :s] = slots
        slot_lists.append(slots)
    seq_lens = torch.tensor([s for s, _ in reqs])
    extend_lens = torch.tensor([e for _, e in reqs])
    q = torch.randn(int(extend_lens.sum()), h, d, generator=g)
    return {
        "q": q, "k_pool": k_pool, "v_pool": v_pool, "req_to_token": req_to_token, "req_pool_indices": rows,
        "seq_lens": seq_lens, "extend_lens": extend_lens, "scale": d**-0.5, "slot_lists": slot_lists,
    }


def run_case(reqs: list[tuple[int, int]], hkv: int, group: int, seed: int) -> None:
    c = make_case(reqs, hkv, group, seed)
    q, k_pool, v_pool, req_to_token = c["q"], c["k_pool"], c["v_pool"], c["req_to_token"]
    rows, seq_lens, extend_lens, scale, slot_lists = (
        c["req_pool_indices"], c["seq_lens"], c["extend_lens"], c["scale"], c["slot_lists"]
    )

    expected = naive(q, k_pool, v_pool, slot_lists, seq_lens.tolist(), extend_lens.tolist(), scale)
    out = paged_attention_ref(q, k_pool, v_pool, req_to_token, rows, seq_lens, extend_lens, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    # With a plan built from host lists (the model's path) the result is the same.
    plan = build_attention_plan(
        req_to_token,
        rows,
        seq_lens,
        extend_lens,
        seq_lens_cpu=seq_lens.tolist(),
        extend_lens_cpu=extend_lens.tolist(),
        req_pool_indices_cpu=rows.tolist(),
    )
    out2 = paged_attention_ref(q, k_pool, v_pool, req_to_token, rows, seq_lens, extend_lens, scale, plan=plan)
    torch.testing.assert_close(out2, expected, atol=2e-5, rtol=1e-5)


CASES = {
    # decodes of very different lengths (several length groups) between prefills, some with a cached prefix
    "mixed": [(30, 1), (25, 25), (140, 1), (60, 17), (3, 1), (9, 9), (75, 1), (41, 40), (2, 1)],
    "decodes-one-group": [(50, 1), (60, 1), (31, 1), (99, 1)],
    "decodes-equal-len": [(20, 1), (20, 1), (20, 1)],
    "decodes-many-groups": [(1, 1), (150, 1), (7, 1), (33, 1), (80, 1), (16, 1)],
    "prefills-only": [(12, 12), (100, 36), (2, 2)],
    "single-prefill": [(64, 64)],
    "single-token-prompt": [(1, 1), (5, 5)],
    # draft verification: a few new tokens over a cached prefix, batched like decodes (by new-token count
    # and length group), beside decodes, a fresh prefill of the same length and a longer chunk
    "verify": [(30, 5), (140, 5), (12, 5), (40, 1), (7, 3), (60, 5), (5, 5), (90, 17), (9, 3)],
    "verify-one-group": [(33, 5), (40, 5), (21, 5)],
}


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_naive(case: str, group: int) -> None:
    run_case(CASES[case], hkv=2, group=group, seed=sorted(CASES).index(case) * 10 + group)


def test_random_batches() -> None:
    g = torch.Generator().manual_seed(7)
    for i in range(10):
        reqs = []
        for _ in range(int(torch.randint(1, 10, (1,), generator=g))):
            s = int(torch.randint(1, 100, (1,), generator=g))
            e = 1 if torch.rand(1, generator=g) < 0.5 else int(torch.randint(1, s + 1, (1,), generator=g))
            reqs.append((s, e))
        run_case(reqs, hkv=int(torch.randint(1, 4, (1,), generator=g)), group=[1, 2, 4][i % 3], seed=i)


def test_chunked_decode_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tiny chunk budget makes every decode group run in several gather chunks.
    monkeypatch.setattr("tandem.kernels.reference.paged_attention.DECODE_CHUNK_BYTES", 1)
    run_case(CASES["mixed"], hkv=2, group=2, seed=11)
    run_case(CASES["decodes-one-group"], hkv=1, group=4, seed=12)
    run_case(CASES["verify"], hkv=2, group=3, seed=13)

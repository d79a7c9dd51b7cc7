"""The CPU backends' attention (decodes run by run with a gathered tail, fresh prefills on their own K/V)
against the torch reference, on KV laid out the way the allocator lays it out: a prompt's slots in one
block (ascending or descending), decode slots scattered after it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels.decode_attention_runs import MIN_RUN, _longest_run
from kernels.reference.paged_attention import paged_attention_ref
from worker.attention_backend import select_attention_backend
from worker.forward_batch import ForwardBatch
from worker.kv_cache import KVCache

HKV, D, SLOTS, ROWS, CTX = 2, 16, 4096, 10, 400


def _layout(rng: random.Random, reqs: list[tuple[int, int, int]]) -> list[list[int]]:
    """reqs: (run length, tail length, extend length); returns each request's slots in position order."""
    free = list(range(1, SLOTS))
    rng.shuffle(free)
    out, block = [], 1
    for run, tail, _ in reqs:
        run_slots = list(range(block, block + run))
        block += run
        if rng.random() < 0.5:
            run_slots.reverse()  # the allocator hands prompt blocks out highest slot first
        taken = set(range(1, block))
        scattered = [s for s in free if s not in taken][:tail]
        free = [s for s in free if s not in scattered]
        cut = rng.randrange(0, len(scattered) + 1)  # some scattered slots may come before the run
        out.append(scattered[:cut] + run_slots + scattered[cut:])
    return out


def _case(seed: int, reqs: list[tuple[int, int, int]], group: int, dtype: torch.dtype = torch.float32) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(1, SLOTS, HKV, D, dtype, "cpu", max_reqs=ROWS, max_context=CTX)
    kv.k[0].normal_(generator=g)
    kv.v[0].normal_(generator=g)
    rows = rng.sample(range(ROWS), len(reqs))
    slot_lists = _layout(rng, reqs)
    for row, slots in zip(rows, slot_lists, strict=True):
        kv.req_to_token[row, : len(slots)] = torch.tensor(slots)
    seq = [len(s) for s in slot_lists]
    ext = [e for _, _, e in reqs]
    locs = [x for s, e in zip(slot_lists, ext, strict=True) for x in s[len(s) - e :]]
    batch = ForwardBatch.from_lists([0] * len(locs), locs, rows, seq, ext)
    t = len(locs)
    q = torch.randn(t, HKV * group, D, generator=g).to(dtype)
    k_new = torch.randn(t, HKV, D, generator=g).to(dtype)
    v_new = torch.randn(t, HKV, D, generator=g).to(dtype)
    outs = {}
    for name in ("torch-runs", "torch", "torch-gather"):
        backend = select_attention_backend(name, torch.device("cpu"))
        outs[name] = backend.forward(0, q, k_new, v_new, kv, backend.plan(batch, kv), D**-0.5)
    if dtype == torch.float32:
        expected = paged_attention_ref(q, kv.k[0], kv.v[0], kv.req_to_token, batch.req_pool_indices,
                                       batch.seq_lens, batch.extend_lens, D**-0.5)
        torch.testing.assert_close(outs["torch-gather"], expected, atol=0, rtol=0)
        torch.testing.assert_close(outs["torch"], expected, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(outs["torch-runs"], expected, atol=2e-6, rtol=1e-5)
    else:  # against the reference in fp32 on the same bf16 values
        expected = paged_attention_ref(q.float(), kv.k[0].float(), kv.v[0].float(), kv.req_to_token,
                                       batch.req_pool_indices, batch.seq_lens, batch.extend_lens, D**-0.5)
        for out in outs.values():
            torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


CASES = {
    "decodes": [(200, 30, 1), (MIN_RUN, 5, 1), (90, 0, 1), (10, 7, 1), (300, 60, 1)],
    "decodes-no-tail": [(100, 0, 1), (64, 0, 1)],
    "decodes-no-run": [(5, 9, 1), (0, 3, 1)],
    # decodes mixed with a fresh prefill (all its slots new) and a prefill over a cached prefix
    "mixed": [(120, 11, 1), (40, 0, 40), (60, 0, 25), (0, 1, 1), (150, 3, 1)],
}


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_backends_match_reference(case: str, group: int) -> None:
    _case(sorted(CASES).index(case) * 10 + group, CASES[case], group)


def test_bf16_close_to_fp32_reference() -> None:
    _case(99, CASES["mixed"], 2, torch.bfloat16)


def test_longest_run() -> None:
    assert _longest_run(np.array([9, 1, 2, 3, 4, 7])) == (1, 5)
    assert _longest_run(np.array([50, 49, 48, 3, 47])) == (0, 3)
    assert _longest_run(np.array([5])) == (0, 1)

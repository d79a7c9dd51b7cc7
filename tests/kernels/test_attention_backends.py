"""Every attention backend resolve_ops can give here (`cpu` with and without its C kernel, `torch` with
fresh prefills on their own K/V, `triton` under the interpreter) against the torch reference, on KV laid
out the way the allocator lays it out: a prompt's slots in one block (ascending or descending), decode
slots scattered after it."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.kernels.reference.paged_attention import paged_attention_ref
from tandem.worker.attention_backend import AttentionBackend, CpuBackend, select_attention_backend
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.kv_cache import KVCache
from tests.kernels.ops_variants import ops_variants

HKV, D, SLOTS, ROWS, CTX = 2, 16, 4096, 10, 400
# Per backend: how close to the reference (which gathers every key) it must come in float32.
TOLERANCE = {"torch": (2e-6, 1e-5), "cpu": (2e-6, 1e-5), "cpu-native": (2e-5, 1e-4), "triton": (2e-5, 1e-4)}


def backends(dtype: torch.dtype) -> dict[str, AttentionBackend]:
    """One backend per distinct attention path resolve_ops can pick here for dtype."""
    out: dict[str, AttentionBackend] = {}
    # The Triton interpreter computes through numpy, which has no bfloat16: triton runs the float32 cases.
    for name in ("cpu", "torch", "triton") if dtype == torch.float32 else ("cpu", "torch"):
        for ops in ops_variants("cpu", dtype, name):
            if ops.attention != name:  # triton only where the interpreter runs it
                continue
            b = select_attention_backend(ops)
            out.setdefault(name + ("-native" if isinstance(b, CpuBackend) and b.native else ""), b)
    return out


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


def _case(seed: int, reqs: list[tuple[int, int, int]], group: int, dtype: torch.dtype = torch.float32,
          kv_dtype: torch.dtype | None = None) -> None:
    """kv_dtype: the pool's (--kv-cache-dtype), by default the model's dtype."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(1, SLOTS, HKV, D, kv_dtype or dtype, "cpu", max_reqs=ROWS, max_context=CTX)
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
    mixed = kv.dtype != dtype  # Triton takes the model's dtype only (the engine refuses the mix on it)
    outs = {name: b.forward(0, q, k_new, v_new, kv, b.plan(batch, kv), D**-0.5)
            for name, b in backends(dtype).items() if not (mixed and name == "triton")}
    assert {"cpu", "torch"} <= {n.removesuffix("-native") for n in outs}
    if mixed:  # every backend attends the pool's values in float32, the output in the model's dtype
        expected = paged_attention_ref(q.float(), kv.k[0].float(), kv.v[0].float(), kv.req_to_token,
                                       batch.req_pool_indices, batch.seq_lens, batch.extend_lens, D**-0.5)
        for name, out in outs.items():
            # a bfloat16 output: its rounding (half an ulp, 2^-9 relative) on top of the float32 tolerance
            atol, rtol = TOLERANCE[name] if dtype == torch.float32 else (1e-5, 2.0**-8)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol,
                                       msg=lambda m, n=name: f"{n}: {m}")
    elif dtype == torch.float32:
        expected = paged_attention_ref(q, kv.k[0], kv.v[0], kv.req_to_token, batch.req_pool_indices,
                                       batch.seq_lens, batch.extend_lens, D**-0.5)
        for name, out in outs.items():
            atol, rtol = TOLERANCE[name]
            torch.testing.assert_close(out, expected, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
    else:  # against the reference in fp32 on the same bf16 values
        expected = paged_attention_ref(q.float(), kv.k[0].float(), kv.v[0].float(), kv.req_to_token,
                                       batch.req_pool_indices, batch.seq_lens, batch.extend_lens, D**-0.5)
        for out in outs.values():
            torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


CASES = {
    "decodes": [(200, 30, 1), (32, 5, 1), (90, 0, 1), (10, 7, 1), (300, 60, 1)],
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


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(("dtype", "kv_dtype"), [(F32, F16), (F32, BF16), (BF16, F16)])
@pytest.mark.parametrize("case", ["decodes", "mixed"])
def test_a_pool_in_another_dtype_matches_the_reference_on_its_values(case: str, dtype, kv_dtype) -> None:
    """--kv-cache-dtype other than the model's: each backend against the float32 reference on the pool's
    values widened (this step's K/V rounded when written, and fresh prefills attend them rounded too), at
    the float32 tolerances (a bfloat16 model: plus its output's rounding)."""
    _case(7 + len(case), CASES[case], 3, dtype, kv_dtype)

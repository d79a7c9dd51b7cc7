"""The input-prep and sample-writeback Triton kernels against their torch references (CPU, under the
Triton interpreter), and prepare_inputs / advance_state with the Triton path forced on vs off."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.input_prep import prepare_inputs_ref
from tandem.kernels.reference.scatter_2d import scatter_2d_ref
from tandem.kernels.triton.input_prep import PREP_BLOCK, prepare_inputs_triton
from tandem.kernels.triton.scatter_2d import scatter_2d_triton
from tandem.protocol.messages import ScheduledReq
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.input_prep import advance_state, plan_prompt_logprobs, prepare_inputs
from tandem.worker.kv_cache import KVCache
from tandem.worker.request_state import RequestState
from tests.kernels.ops_variants import cpu_triton

pytestmark = cpu_triton
MAX_REQS, MAX_CTX = 8, 2 * PREP_BLOCK + 40  # long enough for a chunk that spans three blocks


def _tables(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 50_000, (MAX_REQS, MAX_CTX), generator=g)
    table = torch.randint(0, 1 << 40, (MAX_REQS, MAX_CTX), generator=g)  # past int32 on purpose
    return tokens, table


def _batch(rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    """Random distinct rows with lengths mixing decodes (1), block edges and long chunks."""
    rows = rng.sample(range(MAX_REQS), rng.randint(1, MAX_REQS))
    starts, lens = [], []
    for _ in rows:
        n = rng.choice([1, 1, PREP_BLOCK - 1, PREP_BLOCK, PREP_BLOCK + 1, rng.randint(1, MAX_CTX)])
        lens.append(n)
        starts.append(rng.randint(0, MAX_CTX - n))
    return rows, starts, lens


def _t(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


@pytest.mark.parametrize("seed", range(4))
def test_prepare_kernel_matches_ref(seed: int) -> None:
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    tokens, table = _tables(g)
    rows, starts, lens = _batch(rng)
    cu = [sum(lens[:i]) for i in range(len(lens))]
    args = (tokens, table, _t(rows), _t(starts), _t(lens), _t(cu), sum(lens))
    ref = prepare_inputs_ref(*args)
    tri = prepare_inputs_triton(*args)
    for a, b in zip(ref, tri, strict=True):
        assert a.dtype == b.dtype == torch.int64
        assert torch.equal(a, b)
    # ...and the reference is what it says: each request's tokens, positions and slots, back to back.
    exp_pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    exp_rows = torch.cat([torch.full((n,), r) for r, n in zip(rows, lens)])
    assert torch.equal(ref[1], exp_pos)
    assert torch.equal(ref[0], tokens[exp_rows, exp_pos])
    assert torch.equal(ref[2], table[exp_rows, exp_pos])


@pytest.mark.parametrize("seed", range(3))
def test_table_update_matches_per_request_writes(seed: int) -> None:
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    _, table = _tables(g)
    rows, starts, lens = _batch(rng)
    per_req = table.clone()
    flat_rows, flat_cols, flat_vals = [], [], []
    for r, s, n in zip(rows, starts, lens):
        vals = [rng.randrange(1 << 40) for _ in range(n)]
        per_req[r, s : s + n] = _t(vals)  # the old path: one copy per request
        flat_rows += [r] * n
        flat_cols += range(s, s + n)
        flat_vals += vals
    ref, tri = table.clone(), table.clone()
    scatter_2d_ref(ref, _t(flat_rows), _t(flat_cols), _t(flat_vals))
    scatter_2d_triton(tri, _t(flat_rows), _t(flat_cols), _t(flat_vals))
    assert torch.equal(ref, per_req)
    assert torch.equal(tri, per_req)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_writeback_matches_ref(dtype: torch.dtype) -> None:
    g, rng = torch.Generator().manual_seed(7), random.Random(7)
    tokens, _ = _tables(g)
    for n in (1, 3, MAX_REQS):
        rows = rng.sample(range(MAX_REQS), n)
        cols = [rng.randrange(MAX_CTX) for _ in rows]
        sampled = torch.randint(0, 50_000, (n,), generator=g, dtype=dtype)
        ref, tri = tokens.clone(), tokens.clone()
        scatter_2d_ref(ref, _t(rows), _t(cols), sampled)
        scatter_2d_triton(tri, _t(rows), _t(cols), sampled)
        assert torch.equal(ref, tri)
        assert torch.equal(ref[_t(rows), _t(cols)], sampled.long())


def _state(rng: random.Random) -> tuple[RequestState, KVCache, list[ScheduledReq]]:
    """A CPU request state with random rows mid-prefill / decoding, and a step that schedules them."""
    state = RequestState(MAX_REQS, MAX_CTX, torch.device("cpu"))
    kv = KVCache(1, 16, 1, 4, torch.float32, "cpu", max_reqs=MAX_REQS, max_context=MAX_CTX)
    kv.req_to_token.random_(0, 1 << 40)
    state.tokens.random_(0, 50_000)
    sched = []
    for r in rng.sample(range(MAX_REQS), rng.randint(1, MAX_REQS)):
        known = rng.randint(2, MAX_CTX - 1)
        done = rng.choice([0, known - 1, rng.randint(0, known - 1)])
        n = rng.choice([known - done, 1, min(known - done, PREP_BLOCK + 1)])
        state.num_tokens[r], state.num_computed[r], state.num_prompt[r] = known, done, known
        state.live[r] = True
        if rng.random() < 0.5:  # some rows also want prompt logprobs
            state.prompt_logprobs[r] = 2
            state.prompt_logprob_rows.add(r)
        slot_start = rng.choice([done, 0])  # 0: a new request's prefix-cache hit comes with its slots
        slots = [rng.randrange(1, 1 << 40) for _ in range(done + n - slot_start)]
        sched.append(ScheduledReq(r, n, slot_start, slots, done + n == known))
    return state, kv, sched


def _clone(state: RequestState, kv: KVCache) -> tuple[RequestState, KVCache]:
    s2 = RequestState(MAX_REQS, MAX_CTX, torch.device("cpu"))
    s2.__dict__.update({k: (list(v) if isinstance(v, list) else v) for k, v in state.__dict__.items()})
    s2.tokens = state.tokens.clone()
    kv2 = KVCache(1, 16, 1, 4, torch.float32, "cpu", max_reqs=MAX_REQS, max_context=MAX_CTX)
    kv2.req_to_token = kv.req_to_token.clone()
    return s2, kv2


_TENSORS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "extend_lens")
_LISTS = ("seq_lens_cpu", "extend_lens_cpu", "req_pool_indices_cpu", "extend_starts_cpu", "max_seq_len")


def _assert_same_batch(a: ForwardBatch, b: ForwardBatch) -> None:
    for f in (*_TENSORS, "logits_indices"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f in _LISTS:
        assert getattr(a, f) == getattr(b, f), f


@pytest.mark.parametrize("seed", range(4))
def test_prepare_inputs_triton_path_equals_ref(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    state, kv, sched = _state(random.Random(seed))
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TANDEM_TRITON", flag)
        ops = resolve_ops("cpu", torch.float32)
        st, k = _clone(state, kv)
        plp = plan_prompt_logprobs(sched, st)
        out[flag] = prepare_inputs(sched, st, k, ops, plp), k.req_to_token, plp
    (b0, t0, p0), (b1, t1, p1) = out["0"], out["1"]
    _assert_same_batch(b0, b1)
    assert torch.equal(t0, t1)
    assert (p0 is None) == (p1 is None)
    if p0 is not None and p1 is not None:
        assert torch.equal(p0.targets, p1.targets)
    # The reference path against a plain per-request construction (what prepare_inputs used to do).
    exp_table = kv.req_to_token.clone()
    ids, locs, logits = [], [], []
    total = 0
    for s in sched:
        exp_table[s.req_pool_idx, s.slot_start : s.slot_start + len(s.slots)] = _t(s.slots)
        lo = state.num_computed[s.req_pool_idx]
        ids.append(state.tokens[s.req_pool_idx, lo : lo + s.num_tokens])
        locs.append(exp_table[s.req_pool_idx, lo : lo + s.num_tokens])
        total += s.num_tokens
        if s.sample:
            logits.append(total - 1)
    assert torch.equal(t0, exp_table)
    assert torch.equal(b0.input_ids, torch.cat(ids))
    assert torch.equal(b0.out_cache_loc, torch.cat(locs))
    assert b0.logits_indices.tolist() == logits + (p0.logits_indices if p0 else [])
    assert b0.req_pool_indices_cpu == [s.req_pool_idx for s in sched]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_advance_state_triton_path_equals_ref(as_tensor: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    state, kv, sched = _state(random.Random(11))
    n_sample = sum(s.sample for s in sched)
    sampled = list(range(100, 100 + n_sample))
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("TANDEM_TRITON", flag)
        st, _ = _clone(state, kv)
        advance_state(sched, st, resolve_ops("cpu", torch.float32), _t(sampled) if as_tensor else sampled)
        results.append(st)
    a, b = results
    assert torch.equal(a.tokens, b.tokens)
    assert a.num_tokens == b.num_tokens and a.num_computed == b.num_computed
    it = iter(sampled)
    for s in sched:
        r = s.req_pool_idx
        assert a.num_computed[r] == state.num_computed[r] + s.num_tokens
        if s.sample:
            assert a.num_tokens[r] == state.num_tokens[r] + 1
            assert a.tokens[r, state.num_tokens[r]].item() == next(it)

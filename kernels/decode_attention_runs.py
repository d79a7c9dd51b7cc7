"""CPU decode attention that reads most of each request's KV where it lies in the pool.

The allocator hands a prompt its slots in one block, so a request's KV is mostly one contiguous run of
pool slots (ascending or descending: attention over a set of keys does not care about their order),
plus the decode tokens' slots scattered after it. Gathering every request's whole sequence into a dense
copy for every layer was the largest cost of a CPU decode step. Here each request attends its longest
run as a view of the pool (no copy), only the rest (the "tail") is gathered, padded across the batch,
and the two partial results are merged with their log-sum-exps:

    o = (o_run * exp(lse_run - lse) + o_tail * exp(lse_tail - lse)),  lse = logaddexp(lse_run, lse_tail)

The plan (which run, which tail slots) is worked out once per step on the host and shared by all layers.
Same result as kernels/paged_attention.py's reference (the tests compare them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# A shorter run is left to the gathered tail: per-request calls cost more than copying a few slots.
MIN_RUN = 32


@dataclass
class DecodeRuns:
    token_idx: torch.Tensor | None  # [B] rows of q; None = all of q, in order
    runs: list[tuple[int, int]]  # per request: pool slots lo..hi-1 attended in place (lo == hi: none)
    tail_slots: torch.Tensor | None  # [B * tail_len] the other slots, padded with slot 0; None: no tail
    tail_mask: torch.Tensor | None  # [B, 1, 1, tail_len] True = a real slot; None when nothing is padded
    tail_len: int

    @property
    def size(self) -> int:
        return len(self.runs)


def _longest_run(slots: np.ndarray) -> tuple[int, int]:
    """[a, b): the longest stretch of positions whose slots step by +1 (or all by -1)."""
    n = len(slots)
    if n < 2:
        return 0, n
    d = np.diff(slots)
    best = (0, 1)
    for step in (1, -1):
        breaks = np.flatnonzero(d != step) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [n]))
        j = int(np.argmax(ends - starts))
        if ends[j] - starts[j] > best[1] - best[0]:
            best = (int(starts[j]), int(ends[j]))
    return best


def plan_decode_runs(
    req_to_token: torch.Tensor, rows: Sequence[int], seq_lens: Sequence[int], token_idx: Sequence[int],
    identity: bool,
) -> DecodeRuns:
    """Decode requests (one new token each): their q rows `token_idx`, table rows and lengths.
    `identity`: token_idx is all of q in order. req_to_token must live on the CPU."""
    table = req_to_token.numpy()
    runs: list[tuple[int, int]] = []
    tails: list[np.ndarray] = []
    for row, length in zip(rows, seq_lens, strict=True):
        slots = table[row, :length]
        a, b = _longest_run(slots)
        if b - a < MIN_RUN:
            a = b = 0
        lo, hi = (int(min(slots[a], slots[b - 1])), int(max(slots[a], slots[b - 1])) + 1) if b > a else (0, 0)
        runs.append((lo, hi))
        tails.append(np.concatenate((slots[:a], slots[b:])))
    tail_len = max(len(t) for t in tails)
    tail_slots = tail_mask = None
    if tail_len:
        padded = np.zeros((len(tails), tail_len), dtype=np.int64)  # slot 0: the padding slot, masked
        lens = np.array([len(t) for t in tails])
        for i, t in enumerate(tails):
            padded[i, : len(t)] = t
        tail_slots = torch.from_numpy(padded.reshape(-1))
        if lens.min() != tail_len:
            tail_mask = torch.from_numpy(np.arange(tail_len)[None, :] < lens[:, None])[:, None, None, :]
    idx = None if identity else torch.tensor(list(token_idx))
    return DecodeRuns(idx, runs, tail_slots, tail_mask, tail_len)


def decode_attention_runs(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: DecodeRuns, scale: float
) -> torch.Tensor:
    """q [B, H, D] (the decode rows, in plan order) -> [B, H, D]."""
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    # The G query heads of a KV head act as G query rows; the scale goes on q once.
    qd = (q * scale).unflatten(1, (hkv, h // hkv))  # [B, Hkv, G, D]
    o_run = q.new_zeros(b, hkv, h // hkv, d)
    # The log-sum-exps stay fp32 whatever the KV dtype: they weigh the two halves against each other.
    lse_run = q.new_full((b, hkv, h // hkv), float("-inf"), dtype=torch.float32)
    for i, (lo, hi) in enumerate(plan.runs):
        if hi == lo:
            continue
        s = torch.matmul(qd[i], k_pool[lo:hi].permute(1, 2, 0))  # [Hkv, G, n], K read in place
        torch.logsumexp(s.float(), -1, out=lse_run[i])
        torch.matmul(s.softmax(-1), v_pool[lo:hi].transpose(0, 1), out=o_run[i])
    if plan.tail_slots is None:
        return o_run.view(b, h, d)
    n = plan.tail_len
    k = k_pool.index_select(0, plan.tail_slots).view(b, n, hkv, d).permute(0, 2, 3, 1)  # [B, Hkv, D, n]
    v = v_pool.index_select(0, plan.tail_slots).view(b, n, hkv, d).transpose(1, 2)  # [B, Hkv, n, D]
    s = torch.matmul(qd, k).float()  # [B, Hkv, G, n]
    if plan.tail_mask is not None:
        s.masked_fill_(~plan.tail_mask, float("-inf"))
    lse_tail = s.logsumexp(-1)  # -inf for a request with no tail
    lse = torch.logaddexp(lse_run, lse_tail)
    # exp(s - lse) is the softmax over run and tail together: the tail's share needs no renormalising.
    o_tail = torch.matmul((s - lse[..., None]).exp_().to(v.dtype), v)
    out = o_run.mul_((lse_run - lse).exp_().to(o_run.dtype)[..., None]).add_(o_tail)
    return out.view(b, h, d)

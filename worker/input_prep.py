"""Build a step's ForwardBatch from the persistent request state and the scheduled counts.

This is the plain reference path (CPU lists -> tensors); the device path (Triton) builds the same
tensors from the same state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.messages import ScheduledReq
from worker.forward_batch import ForwardBatch
from worker.kv_cache import KVCache
from worker.request_state import RequestState


@dataclass
class PromptLogprobsPlan:
    """Prompt positions whose logits a step must also return, for the rows that asked for prompt logprobs.
    Their logits follow the sampling rows' logits, request after request."""

    logits_indices: list[int]  # indices into the step's flattened tokens
    rows: list[int]  # request rows, each with counts[i] consecutive logits rows
    counts: list[int]
    top_ns: list[int]
    targets: torch.Tensor  # [sum(counts)] int64: the prompt token each of those logits predicts


def plan_prompt_logprobs(sched: list[ScheduledReq], state: RequestState) -> PromptLogprobsPlan | None:
    """The logits at positions start .. end-1 of a step's chunk predict tokens start+1 .. end; those whose
    target is a prompt token (index < num_prompt) are reported. None when no row needs any."""
    if not state.prompt_logprob_rows:
        return None
    idx: list[int] = []
    rows: list[int] = []
    counts: list[int] = []
    tgt_rows: list[int] = []
    tgt_cols: list[int] = []
    total = 0
    for s in sched:
        r = s.req_idx
        if r in state.prompt_logprob_rows:
            start = state.num_computed[r]
            count = min(start + s.num_tokens, state.num_prompt[r] - 1) - start
            if count > 0:
                idx += range(total, total + count)
                rows.append(r)
                counts.append(count)
                tgt_rows += [r] * count
                tgt_cols += range(start + 1, start + 1 + count)
        total += s.num_tokens
    if not rows:
        return None
    dev = state.device
    targets = state.tokens[torch.tensor(tgt_rows, device=dev), torch.tensor(tgt_cols, device=dev)]
    top_ns = [state.prompt_logprobs[r] for r in rows]
    return PromptLogprobsPlan(idx, rows, counts, top_ns, targets)


def prepare_inputs(
    sched: list[ScheduledReq], state: RequestState, kv: KVCache, prompt_lp: PromptLogprobsPlan | None = None
) -> ForwardBatch:
    """The step's batch. Its logits_indices: the last token of every request that samples, in scheduled
    order, then prompt_lp.logits_indices when given."""
    device = state.device
    rows: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    logits_idx: list[int] = []
    total = 0
    for s in sched:
        r = s.req_idx
        start = state.num_computed[r]
        if start + s.num_tokens > state.num_tokens[r]:
            raise RuntimeError(f"row {r}: asked for tokens up to {start + s.num_tokens}, knows {state.num_tokens[r]}")
        if s.slots:
            kv.req_to_token[r, s.slot_start : s.slot_start + len(s.slots)] = torch.tensor(s.slots, dtype=torch.int64)
        rows.append(r)
        starts.append(start)
        lens.append(s.num_tokens)
        total += s.num_tokens
        if s.sample:
            logits_idx.append(total - 1)
    rows_t = torch.tensor(rows, dtype=torch.int64)
    extend = torch.tensor(lens, dtype=torch.int64)
    start_t = torch.tensor(starts, dtype=torch.int64)
    seq_lens = start_t + extend
    # positions: start_i + 0..len_i-1 for each request, flattened.
    req_of_tok = torch.repeat_interleave(torch.arange(len(rows)), extend)
    offsets = torch.arange(total) - torch.repeat_interleave(torch.cumsum(extend, 0) - extend, extend)
    positions = start_t[req_of_tok] + offsets
    tok_rows = rows_t[req_of_tok]
    tokens_dev = state.tokens
    rows_d, pos_d = tok_rows.to(device), positions.to(device)
    return ForwardBatch.build(
        input_ids=tokens_dev[rows_d, pos_d],
        positions=pos_d,
        out_cache_loc=kv.req_to_token[rows_d, pos_d],
        req_pool_indices=rows_t.to(device),
        seq_lens=seq_lens.to(device),
        extend_lens=extend.to(device),
        logits_indices=torch.tensor(
            logits_idx if prompt_lp is None else logits_idx + prompt_lp.logits_indices,
            dtype=torch.int64,
            device=device,
        ),
        seq_lens_cpu=[s + n for s, n in zip(starts, lens)],
        extend_lens_cpu=lens,
        req_pool_indices_cpu=rows,
    )


def advance_state(sched: list[ScheduledReq], state: RequestState, sampled: list[int]) -> None:
    """After the step: computed counters move, sampled tokens join each row's token buffer."""
    rows: list[int] = []
    cols: list[int] = []
    for s in sched:
        r = s.req_idx
        state.num_computed[r] += s.num_tokens
        if s.sample:
            n = state.num_tokens[r]
            if n >= state.max_context:
                raise RuntimeError(f"row {r} exceeds the context of {state.max_context}")
            rows.append(r)
            cols.append(n)
            state.num_tokens[r] = n + 1
    if rows:
        state.tokens[rows, cols] = torch.tensor(sampled, dtype=torch.int64, device=state.device)

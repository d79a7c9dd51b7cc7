"""Build a step's ForwardBatch from the persistent request state and the scheduled counts.

The host only packs a few small index arrays (one H2D copy per step); the flat token arrays are
gathered on the device from the request state, and sampled tokens are written back there, by the ops
kernels/ops.py chose (the Triton kernels on CUDA, the torch references elsewhere), so the next step's input
prep needs no host round trip (docs/architecture.md §4).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.kernels.ops import Ops
from tandem.protocol.messages import ScheduledReq
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.host_to_device import to_device
from tandem.worker.kv_cache import KVCache
from tandem.worker.request_state import RequestState


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
    target is a prompt token at or after the row's prompt_logprob_start are reported. None when no row needs
    any."""
    if not state.prompt_logprob_rows:
        return None
    idx: list[int] = []
    rows: list[int] = []
    counts: list[int] = []
    tgt_rows: list[int] = []
    tgt_cols: list[int] = []
    total = 0
    for s in sched:
        r = s.req_pool_idx
        if r in state.prompt_logprob_rows:
            start = state.num_computed[r]
            lo = max(start, state.prompt_logprob_start[r] - 1)  # logits at lo predict token lo + 1
            count = min(start + s.num_tokens, state.num_prompt[r] - 1) - lo
            if count > 0:
                idx += range(total + lo - start, total + lo - start + count)
                rows.append(r)
                counts.append(count)
                tgt_rows += [r] * count
                tgt_cols += range(lo + 1, lo + 1 + count)
        total += s.num_tokens
    if not rows:
        return None
    rows_t, cols_t = to_device([tgt_rows, tgt_cols], state.device)
    targets = state.tokens[rows_t, cols_t]
    top_ns = [state.prompt_logprobs[r] for r in rows]
    return PromptLogprobsPlan(idx, rows, counts, top_ns, targets)


def prepare_inputs(
    sched: list[ScheduledReq], state: RequestState, kv: KVCache, ops: Ops,
    prompt_lp: PromptLogprobsPlan | None = None, pool_indices: list[int] | None = None,
) -> ForwardBatch:
    """The step's batch. Its logits_indices: the last known token of every request that samples, then
    its draft tokens if it has some, in scheduled order; then prompt_lp.logits_indices when given; then
    pool_indices (tokens whose hidden states an embedding pools)."""
    device = state.device
    rows: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    cu_lens: list[int] = []
    seq_lens: list[int] = []
    logits_idx: list[int] = []
    # This step's new KV slots, all requests together: table[slot_rows[k], slot_cols[k]] = slot_vals[k]
    # (and, with a sliding-window pool, swa_map[slot_vals[k]] = swa_vals[k]).
    slot_rows = array("q")
    slot_cols = array("q")
    slot_vals: list[int] = []
    swa_vals: list[int] = []
    total = 0
    for s in sched:
        r = s.req_pool_idx
        start = state.num_computed[r]
        known = start + s.num_tokens - s.num_drafts  # drafts sit past the known tokens, verified at the end
        if known > state.num_tokens[r] or (s.num_drafts and known != state.num_tokens[r]):
            raise RuntimeError(
                f"row {r}: asked for tokens up to {start + s.num_tokens} with {s.num_drafts} drafts, "
                f"knows {state.num_tokens[r]}"
            )
        if s.slots:
            slot_rows.extend(array("q", [r]) * len(s.slots))
            slot_cols.extend(range(s.slot_start, s.slot_start + len(s.slots)))
            slot_vals += s.slots
            swa_vals += s.swa_slots
        rows.append(r)
        starts.append(start)
        lens.append(s.num_tokens)
        cu_lens.append(total)
        seq_lens.append(start + s.num_tokens)
        total += s.num_tokens
        if s.sample:  # with drafts: every draft position too, to verify it
            logits_idx += range(total - 1 - s.num_drafts, total)
    if prompt_lp is not None:
        logits_idx += prompt_lp.logits_indices
    if pool_indices:
        logits_idx += pool_indices
    rows_t, starts_t, lens_t, cu_t, seq_t, logits_t, srow_t, scol_t, sval_t = to_device(
        [rows, starts, lens, cu_lens, seq_lens, logits_idx, slot_rows, slot_cols, slot_vals], device
    )
    # The table first: this step's tokens read their slots back from it below.
    ops.scatter_2d(kv.req_to_token, srow_t, scol_t, sval_t)
    if kv.swa_map is not None and slot_vals:
        if len(swa_vals) != len(slot_vals):  # a scheduler that does not know the worker's sliding pool
            raise RuntimeError(f"{len(swa_vals)} sliding-window slots for {len(slot_vals)} slots")
        kv.map_swa(sval_t, to_device([swa_vals], device)[0])
    input_ids, positions, out_cache_loc = ops.prepare_inputs(
        state.tokens, kv.req_to_token, rows_t, starts_t, lens_t, cu_t, total
    )
    return ForwardBatch.build(
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=rows_t,
        seq_lens=seq_t,
        extend_lens=lens_t,
        logits_indices=logits_t,
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=lens,
        req_pool_indices_cpu=rows,
    )


def advance_state(
    sched: list[ScheduledReq],
    state: RequestState,
    ops: Ops,
    sampled: Sequence[int] | torch.Tensor,
    counts: Sequence[int] | None = None,
) -> None:
    """After the step: computed counters move, sampled tokens join each row's token buffer. `sampled`
    may be the sampler's device tensor (in sampling order), which then never visits the host.
    counts: tokens per sampling request (speculation: 1 + its accepted drafts; None: one each)."""
    rows: list[int] = []
    cols: list[int] = []
    k = 0
    for s in sched:
        r = s.req_pool_idx
        if not s.sample:
            state.num_computed[r] += s.num_tokens
            continue
        c = counts[k] if counts is not None else 1
        k += 1
        # Rejected drafts were computed but are not the row's: their KV is overwritten later.
        state.num_computed[r] += s.num_tokens - s.num_drafts + c - 1
        n = state.num_tokens[r]
        if n + c > state.max_context:
            raise RuntimeError(f"row {r} exceeds the context of {state.max_context}")
        rows += [r] * c
        cols += range(n, n + c)
        state.num_tokens[r] = n + c
    if not rows:
        return
    if isinstance(sampled, torch.Tensor):
        rows_t, cols_t = to_device([rows, cols], state.device)
        sampled_t = sampled.to(state.device)
    else:
        rows_t, cols_t, sampled_t = to_device([rows, cols, sampled], state.device)
    ops.scatter_2d(state.tokens, rows_t, cols_t, sampled_t)

"""Paged attention over a slot-addressed KV pool, in plain torch (the `torch` backend, and the reference).

Layout: q [T, H, D] holds the new tokens of B requests back to back; request i has extend_lens[i] new
tokens that sit at positions seq_lens[i]-extend_lens[i] .. seq_lens[i]-1 and attend (causally) over the
KV slots req_to_token[req_pool_indices[i], :seq_lens[i]], which already include this step's K/V.
A sliding-window layer (window W > 0) attends a query at position p over keys p-W+1 .. p only; the slots
before those are never gathered (their KV may have been freed). `slot_map` (a sliding layers' pool of its
own) turns a table's slot into the slot of that pool: slot_map[req_to_token[...]].

Speed: everything that does not depend on the layer (which slots to gather, masks, grouping) is worked
out once per step in an AttentionPlan and reused by every layer. Single-token requests (decodes), and
requests with a few new tokens over a cached prefix (draft verification), run as padded batches --
grouped by new-token count and by similar length so padding costs at most ~2x -- with GQA handled by
viewing the G query heads of a KV head as G query rows (no K/V repeat). Other multi-token requests
(prefills, chunks) run one SDPA each.
Gathered K/V go into persistent buffers (kernels/workspace.py), a cache-sized chunk of decodes at a time.
A pool in another dtype than q's (--kv-cache-dtype) is attended in float32: the gathered K/V and q widened
(q8_0 blocks dequantized, kernels/reference/kv_quant.py), the output rounded back to q's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.kernels.reference.kv_quant import to_pool, widen
from tandem.kernels.workspace import WORKSPACE

# Gathered K+V per decode chunk: well inside a server L3, so SDPA re-reads it from cache, not DRAM.
DECODE_CHUNK_BYTES = 8 << 20


def _compute_dtype(q: torch.Tensor, k_pool: torch.Tensor) -> torch.dtype:
    """q's dtype, or float32 for a pool in another (SDPA takes one dtype; float32 loses nothing of either, nor
    of q8_0's values)."""
    return q.dtype if k_pool.dtype == q.dtype else torch.float32


def _gather(name: str, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = WORKSPACE.get(name, (slots.numel(), *pool.shape[1:]), pool)
    return torch.index_select(pool, 0, slots, out=out)


@dataclass
class DecodeGroup:
    """Requests with the same few new tokens (q_len: 1 for decodes, 1 + K to verify K drafts) over a
    cached prefix, attended as one padded batch."""

    token_idx: torch.Tensor | None  # [Bd * q_len] rows of q / out; None = all of q, in order
    slots: torch.Tensor  # [Bd * L] KV slots, padded with slot 0
    mask: torch.Tensor | None  # [Bd, 1, q_len, L] bool, True = attend; None when nothing is masked
    size: int
    max_len: int  # keys gathered per request (from its position `lo` on)
    q_len: int = 1
    _rows_mask: torch.Tensor | None = None  # mask with each query's G head rows, built by the first layer

    def mask_for(self, group: int) -> torch.Tensor | None:
        """The mask for q laid out [Bd, Hkv, q_len * G, D] (query j's G heads are rows j*G .. j*G+G-1)."""
        if self.q_len == 1 or self.mask is None:
            return self.mask
        if self._rows_mask is None or self._rows_mask.shape[2] != self.q_len * group:
            self._rows_mask = self.mask.repeat_interleave(group, dim=2)
        return self._rows_mask


@dataclass
class ExtendSeg:
    start: int  # first row in q
    length: int  # new tokens
    slots: torch.Tensor  # [seq_len] KV slots of the whole sequence
    mask: torch.Tensor | None  # [length, seq_len] bool, or None for a fresh prefill (plain causal)


@dataclass
class AttentionPlan:
    num_tokens: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    extends: list[ExtendSeg] = field(default_factory=list)


# Multi-token requests over a cached prefix with at most this many new tokens (draft verification) are
# batched like decodes: one SDPA per request and layer cost more than the attention itself.
SHORT_EXTEND = 16


def _group_decodes(reqs: list[int], seq_lens: Sequence[int]) -> list[list[int]]:
    """Split decode requests into groups whose lengths are within 2x of the group's longest."""
    if not reqs or min(seq_lens[i] for i in reqs) * 2 > max(seq_lens[i] for i in reqs):
        return [reqs] if reqs else []  # one group keeps the original order (no scatter needed)
    groups: list[list[int]] = []
    for i in sorted(reqs, key=lambda r: -seq_lens[r]):
        if groups and seq_lens[i] * 2 > seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def build_attention_plan(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    *,
    seq_lens_cpu: Sequence[int] | None = None,
    extend_lens_cpu: Sequence[int] | None = None,
    req_pool_indices_cpu: Sequence[int] | None = None,
    decodes: bool = True,
    window: int = 0,
    slot_map: torch.Tensor | None = None,
    image_spans: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> AttentionPlan:
    """decodes=False: plan the multi-token requests only (the caller attends the decodes its own way).
    window: a sliding-window layer's keys (0: all); slot_map: see the module doc. image_spans: per request,
    [a, b) position ranges whose queries also see every key of the range (an image Gemma 3 attends both
    ways; the step holds all of it): keys up to b - 1, still no further back than the window."""
    seq_l = list(seq_lens_cpu) if seq_lens_cpu is not None else seq_lens.tolist()
    ext_l = list(extend_lens_cpu) if extend_lens_cpu is not None else extend_lens.tolist()
    rows = list(req_pool_indices_cpu) if req_pool_indices_cpu is not None else req_pool_indices.tolist()
    dev = req_to_token.device
    starts, t = [], 0
    for e in ext_l:
        starts.append(t)
        t += e
    plan = AttentionPlan(num_tokens=t)

    by_len: dict[int, list[int]] = {}  # new tokens -> requests attended as padded batches
    for i, e in enumerate(ext_l):
        if image_spans and image_spans[i] and e > 1:
            continue  # attended alone below, with its own mask
        if (e == 1 and decodes) or 1 < e <= SHORT_EXTEND and seq_l[i] > e:
            by_len.setdefault(e, []).append(i)
    for e, reqs in by_len.items():
        for grp in _group_decodes(reqs, seq_l):
            plan.decode_groups.append(
                _padded_group(req_to_token, rows, seq_l, starts, t, grp, e, window, slot_map)
            )
    batched = {i for reqs in by_len.values() for i in reqs}

    for i, e in enumerate(ext_l):
        if e <= 1 or i in batched:  # decodes are grouped above or run by the caller; e == 0: no queries
            continue
        s, prefix = seq_l[i], seq_l[i] - e
        lo = max(0, prefix - window + 1) if window else 0  # the first query's first key
        mask = None
        spans = image_spans[i] if image_spans else ()
        if prefix > 0 or (window and e > window) or spans:  # query j sits at position prefix + j
            query_pos = torch.arange(prefix, s, device=dev)
            last = query_pos.clone()  # the last key each query sees
            for a, b in spans:
                last[max(a, prefix) - prefix : b - prefix] = b - 1
            key_pos = torch.arange(lo, s, device=dev)[None, :]
            mask = _visible(key_pos, query_pos[:, None], window, last[:, None])
        slots = req_to_token[rows[i], lo:s]
        plan.extends.append(ExtendSeg(starts[i], e, slots if slot_map is None else slot_map[slots], mask))
    return plan


def _visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int, last: torch.Tensor | None = None,
             ) -> torch.Tensor:
    """True where a query at query_pos sees the key at key_pos (broadcast): up to `last` (default: itself,
    causal), and within the window before it."""
    seen = key_pos <= (query_pos if last is None else last)
    return seen if not window else seen & (key_pos > query_pos - window)


def _padded_group(
    req_to_token: torch.Tensor, rows: list[int], seq_l: list[int], starts: list[int], t: int, grp: list[int],
    q_len: int, window: int = 0, slot_map: torch.Tensor | None = None,
) -> DecodeGroup:
    dev = req_to_token.device
    lens = [seq_l[i] for i in grp]
    max_len = max(lens)
    # With a window, keys before every request's first query's window are not gathered at all.
    lo = min(max(0, n - q_len - window + 1) for n in lens) if window else 0
    table = req_to_token[torch.tensor([rows[i] for i in grp], device=dev), lo:max_len]
    mask = None
    if min(lens) != max_len or q_len > 1:  # else the columns gathered are exactly every query's keys
        # Query j of a request sits at position len - q_len + j and sees keys up to it (and, with a window,
        # from W - 1 before it).
        len_t = torch.tensor(lens, device=dev)[:, None]
        last = len_t - q_len + torch.arange(q_len, device=dev)[None, :]
        key_pos = torch.arange(lo, max_len, device=dev)
        mask = _visible(key_pos[None, None, :], last[:, :, None], window)  # [Bd, q_len, L]
        # Slots past a request's length, or before its first query's window, may hold anything (their KV may
        # be freed); point them at slot 0 (masked anyway).
        outside = key_pos[None, :] >= len_t
        if window:
            outside |= key_pos[None, :] < len_t - q_len - window + 1
        table = table.masked_fill(outside, 0)
        mask = mask[:, None]
    if slot_map is not None:
        table = slot_map[table]
    tok = [starts[i] + j for i in grp for j in range(q_len)]
    identity = len(tok) == t and tok == list(range(t))
    return DecodeGroup(
        token_idx=None if identity else torch.tensor(tok, device=dev), slots=table.reshape(-1), mask=mask,
        size=len(grp), max_len=max_len - lo, q_len=q_len,
    )


def paged_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int = 0,
    slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D]; k_pool/v_pool [num_slots, Hkv, D] -> out [T, H, D]. Pass `plan` (from
    build_attention_plan) to share the per-step bookkeeping across layers. `new_kv`: this step's K/V
    [T, Hkv, D], already written to the pools; a prefill with no cached prefix attends them as they are
    instead of gathering the same values back from the pool. window, slot_map: build_attention_plan's (a
    plan given was built with its own)."""
    if plan is None:
        plan = build_attention_plan(req_to_token, req_pool_indices, seq_lens, extend_lens, window=window,
                                    slot_map=slot_map)
    T, H, D = q.shape
    cd = _compute_dtype(q, k_pool)
    hkv = k_pool.shape[1]
    group = H // hkv
    out = None

    for g in plan.decode_groups:
        # unflatten, not view: q may be a strided view (the model rotates q and k in one tensor).
        qd = (q if g.token_idx is None else q.index_select(0, g.token_idx)).to(cd).unflatten(1, (hkv, group))
        rows_per = g.q_len * group
        if g.q_len > 1:  # [Bd * q_len, Hkv, G, D] -> [Bd, Hkv, q_len * G, D]
            qd = qd.view(g.size, g.q_len, hkv, group, D).transpose(1, 2).reshape(g.size, hkv, rows_per, D)
        o = qd.new_empty(g.size, hkv, rows_per, D)
        full_mask = g.mask_for(group)
        # Gather a few requests at a time so their K/V is still in cache when SDPA reads it back.
        row_bytes = 2 * g.max_len * hkv * k_pool.shape[2] * k_pool.element_size()
        chunk = max(1, DECODE_CHUNK_BYTES // row_bytes)
        for c0 in range(0, g.size, chunk):
            n = min(chunk, g.size - c0)
            slots = g.slots[c0 * g.max_len : (c0 + n) * g.max_len]
            # [n, L, Hkv, D] -> [n, Hkv, L, D]; the G query heads of each KV head act as G query rows.
            k = widen(_gather("k", k_pool, slots), cd).view(n, g.max_len, hkv, D).transpose(1, 2)
            v = widen(_gather("v", v_pool, slots), cd).view(n, g.max_len, hkv, D).transpose(1, 2)
            mask = None if full_mask is None else full_mask[c0 : c0 + n]
            o[c0 : c0 + n] = F.scaled_dot_product_attention(
                qd[c0 : c0 + n], k, v, attn_mask=mask, scale=scale
            )
        if g.q_len > 1:
            o = o.view(g.size, hkv, g.q_len, group, D).transpose(1, 2)
        o = o.reshape(g.size * g.q_len, H, D).to(q.dtype)
        if g.token_idx is None:
            return o  # the whole batch was one decode group
        if out is None:
            out = q.new_empty(T, H, D)
        out.index_copy_(0, g.token_idx, o)

    if out is None:
        out = q.new_empty(T, H, D)
    return attend_extends(out, q, k_pool, v_pool, plan.extends, scale, new_kv)


def attend_extends(
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    extends: list[ExtendSeg],
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The plan's multi-token requests (prefills, chunks): one SDPA each, written into their rows of out."""
    group, cd = q.shape[1] // k_pool.shape[1], _compute_dtype(q, k_pool)
    for seg in extends:
        rows = slice(seg.start, seg.start + seg.length)
        qs = q[rows].transpose(0, 1).unsqueeze(0).to(cd)  # [1, H, E, D]
        # fresh prefill: its keys are this step's, as stored
        if new_kv is not None and len(seg.slots) == seg.length:
            k, v = (widen(to_pool(x[rows].transpose(0, 1).unsqueeze(0), k_pool.dtype), cd) for x in new_kv)
        else:
            k = widen(_gather("k", k_pool, seg.slots), cd).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
            v = widen(_gather("v", v_pool, seg.slots), cd).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale, enable_gqa=group > 1
        )
        out[rows] = o[0].transpose(0, 1)
    return out

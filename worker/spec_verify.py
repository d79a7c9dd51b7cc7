"""Speculative decoding, the worker's side: verify draft tokens against the target's logits at every
draft position, and propose the next step's drafts on the device.

Greedy rows accept the longest prefix of drafts equal to the target's argmax, plus the argmax after
it. Sampled rows use the rejection rule for a deterministic proposer: draft d at a position is
accepted with probability p(d); at the first rejection the token is drawn from p with d removed and
renormalised; after all are accepted, a bonus token from p. Each emitted token is then distributed
exactly as p (P(d) = p(d), P(x != d) = (1 - p(d)) * p(x) / (1 - p(d))), so outputs follow the
target's distribution whatever the drafts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import torch

from tandem.kernels.ops import Ops
from tandem.protocol.messages import Logprobs, ScheduledReq, SchedulerOutput
from tandem.protocol.sampling_params import GREEDY_BELOW_TEMPERATURE
from tandem.worker.host_to_device import to_device
from tandem.worker.request_state import RequestState
from tandem.worker.sampler import sampling_probs


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    temps: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    min_ps: Sequence[float],
    generator: Callable[[int, int], torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, K+1, V] at each request's last known token and its K draft positions (rows past a
    request's num_drafts[b] are padding); drafts [B, K]. generator(b, j): seeded for the draws at
    position j of request b, just before they are made (None: unseeded). Returns tokens [B, K+1] and
    counts [B]: request b emits tokens[b, :counts[b]]."""
    b, k1, vocab = logits.shape
    k = k1 - 1
    dev = logits.device
    pos = torch.arange(k, device=dev)
    valid = pos[None, :] < num_drafts[:, None]
    greedy = [t < GREEDY_BELOW_TEMPERATURE or tk == 1 for t, tk in zip(temps, top_ks, strict=True)]
    out = torch.empty(b, k1, dtype=torch.int64, device=dev)
    accepted = torch.empty(b, dtype=torch.int64, device=dev)
    g_rows = [i for i in range(b) if greedy[i]]
    s_rows = [i for i in range(b) if not greedy[i]]
    if g_rows:
        gi = torch.tensor(g_rows, device=dev)
        target = logits[gi].argmax(dim=-1)
        ok = (drafts[gi] == target[:, :k]) & valid[gi]
        accepted[gi] = ok.long().cumprod(dim=-1).sum(dim=-1)
        out[gi] = target  # accepted drafts equal the target there
    if s_rows:
        si = torch.tensor(s_rows, device=dev)
        rep = [j for i in s_rows for j in [i] * k1]
        probs = sampling_probs(
            logits[si].reshape(-1, vocab), [temps[i] for i in rep], [top_ks[i] for i in rep],
            [top_ps[i] for i in rep], [min_ps[i] for i in rep],
        ).view(len(s_rows), k1, vocab)
        d = drafts[si]
        # One uniform (accept?) and V uniforms (the exponential race) per position.
        u = torch.empty(len(s_rows), k1, vocab + 1, device=dev, dtype=probs.dtype).uniform_()
        for r, i in enumerate(s_rows):
            for j in range(k1):
                g = generator(i, j)
                if g is not None:  # seeded: this position's draws depend on the seed alone
                    u[r, j].uniform_(generator=g)
        p_d = probs[:, :k].gather(-1, d[..., None]).squeeze(-1)
        ok = (u[:, :k, 0] < p_d) & valid[si]
        acc = ok.long().cumprod(dim=-1).sum(dim=-1)
        # Residual at each draft position: p without the draft (only where a draft was verified).
        drop = torch.zeros(len(s_rows), k1, vocab, dtype=torch.bool, device=dev)
        drop[:, :k].scatter_(-1, d[..., None], valid[si][..., None])
        resid = probs.masked_fill(drop, 0.0)
        # p(d) == 1 within rounding and rejected anyway: nothing is left; keep p.
        resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, probs)
        drawn = (resid / u[..., 1:].log_().neg_()).argmax(dim=-1)
        padded = torch.cat([d, d[:, :1]], dim=-1)
        out[si] = torch.where(torch.arange(k1, device=dev)[None, :] < acc[:, None], padded, drawn)
        accepted[si] = acc
    return out, accepted + 1


def sampler_logit_rows(sched: list[ScheduledReq]) -> list[int]:
    """Each sampling request's first row among the step's sampling logits (1 + num_drafts rows each)."""
    rows, n = [], 0
    for s in sched:
        if s.sample:
            rows.append(n)
            n += 1 + s.num_drafts
    return rows


PlainSampler = Callable[[torch.Tensor, list[int]], tuple[torch.Tensor, list[Logprobs | None] | None]]


def sample_with_drafts(
    logits: torch.Tensor, sched: list[ScheduledReq], state: RequestState, sample_plain: PlainSampler
) -> tuple[torch.Tensor, list[int], list[Logprobs | None] | None]:
    """The sampling logits of a step with drafts ([sum over samplers of 1 + num_drafts, V], in scheduled
    order) -> every sampling request's tokens (flat, in order, on the device), their counts, and
    logprobs per request (only plain ones have any). Requests without drafts go to sample_plain (the
    runner's sampler, with penalties and logprobs). Reads the accepted counts to the host (a sync)."""
    samplers = [s for s in sched if s.sample]
    offsets = sampler_logit_rows(sched)
    dev = logits.device
    plain = [i for i, s in enumerate(samplers) if not s.num_drafts]
    spec = [i for i, s in enumerate(samplers) if s.num_drafts]
    parts: list[torch.Tensor] = []
    plain_lps = None
    if plain:
        plain_tokens, plain_lps = sample_plain(
            logits[torch.tensor([offsets[i] for i in plain], device=dev)],
            [samplers[i].req_pool_idx for i in plain],
        )
        parts.append(plain_tokens)
    k = max(samplers[i].num_drafts for i in spec)
    rows = [samplers[i].req_pool_idx for i in spec]
    nd = [samplers[i].num_drafts for i in spec]
    # [n_spec, K+1] logits rows and [n_spec, K] drafts; padding past a request's drafts repeats its last.
    idx = [offsets[i] + min(j, n) for i, n in zip(spec, nd) for j in range(k + 1)]
    cols = [state.num_tokens[r] + min(j, n - 1) for r, n in zip(rows, nd) for j in range(k)]
    idx_t, rows_t, cols_t, nd_t = to_device([idx, [r for r in rows for _ in range(k)], cols, nd], dev)
    drafts = state.tokens[rows_t, cols_t].view(len(spec), k)
    out, counts_t = verify(
        logits[idx_t].view(len(spec), k + 1, -1), drafts, nd_t,
        [state.temperature[r] for r in rows], [state.top_k[r] for r in rows],
        [state.top_p[r] for r in rows], [state.min_p[r] for r in rows],
        lambda b, j: state.seeded_generator(rows[b], j),
    )
    parts.append(out.flatten())
    spec_counts = counts_t.tolist()
    # Gather each request's tokens, in sampling order, from [plain tokens | spec tokens row by row].
    counts = [1] * len(samplers)
    take: list[int] = []
    base = len(plain)
    p_of = {i: n for n, i in enumerate(plain)}
    q_of = {i: n for n, i in enumerate(spec)}
    for i in range(len(samplers)):
        if i in p_of:
            take.append(p_of[i])
        else:
            q = q_of[i]
            counts[i] = spec_counts[q]
            take += range(base + q * (k + 1), base + q * (k + 1) + counts[i])
    tokens = torch.cat(parts)[torch.tensor(take, device=dev)]
    lps: list[Logprobs | None] | None = None
    if plain_lps is not None:
        lps = [None] * len(samplers)
        for n, i in enumerate(plain):
            lps[i] = plain_lps[n]
    return tokens, counts, lps


def propose_drafts(
    sched: list[ScheduledReq], state: RequestState, ops: Ops, k: int, min_n: int, max_n: int
) -> None:
    """Drafts for every row that just sampled, written past its known tokens (state already advanced).
    A host proposer (ops.host_drafts) also records how many of its matched drafts each row will verify
    (state.num_proposed: as many as its acceptance record says pay off at this batch size)."""
    rows = [s.req_pool_idx for s in sched if s.sample]
    if not rows:
        return
    rows_t, lens_t = to_device([rows, [state.num_tokens[r] for r in rows]], state.device)
    found = ops.propose_ngram(state.tokens, rows_t, lens_t, k, min_n, max_n)
    if not ops.host_drafts or found is None:  # the device proposer keeps its matches on the device
        return
    for r, n in zip(rows, found, strict=True):
        state.num_proposed[r] = state.draft_record[r].worth(n, len(rows))


def record_drafts(
    sched: list[ScheduledReq], num_sampled: list[int] | None, state: RequestState, ops: Ops
) -> None:
    """After a step of the host proposer's path (`sched` as trimmed: the drafts each row verified), each
    sampling row's acceptance record learns how its drafts fared; num_sampled: tokens per sampling row
    (None: no row had drafts). The device proposer keeps no records: every draft is verified."""
    if not ops.host_drafts:
        return
    for i, s in enumerate(s for s in sched if s.sample):
        rec = state.draft_record[s.req_pool_idx]
        if s.num_drafts and num_sampled is not None:
            rec.verified(s.num_drafts, num_sampled[i] - 1)
        else:
            rec.skipped()


def trim_drafts(so: SchedulerOutput, state: RequestState, ops: Ops) -> SchedulerOutput:
    """The step as the worker runs it: where the proposer ran on the host, a row verifies only the drafts
    it matched, so a row without a match computes one token, like a plain decode. The scheduler reserved
    KV for all it scheduled; the table still gets every slot (a step in flight may already count on
    them), and the rollback at commit returns the unused ones as it does for rejected drafts. With the
    device proposer the counts stay on the device: every scheduled draft is verified."""
    if not ops.host_drafts or not any(s.num_drafts for s in so.scheduled):
        return so
    items = []
    for s in so.scheduled:
        cut = s.num_drafts - min(s.num_drafts, state.num_proposed[s.req_pool_idx])
        items.append(msgspec.structs.replace(s, num_tokens=s.num_tokens - cut, num_drafts=s.num_drafts - cut)
                     if cut else s)
    return msgspec.structs.replace(so, scheduled=items)

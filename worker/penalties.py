"""Logits processing before sampling (vLLM semantics): repetition / frequency / presence penalties and
min_tokens. Applied only to the rows that use them; an all-defaults batch never reaches this code."""

from __future__ import annotations

import torch

from tandem.worker.host_to_device import to_device
from tandem.worker.request_state import RequestState


def apply_penalties_(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    num_prompt: torch.Tensor,
    num_tokens: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    use_repetition: bool = True,
    use_counts: bool = True,
) -> torch.Tensor:
    """In place on logits [k, V]; tokens [k, L]: each row's prompt then its outputs, L = max(num_tokens)
    (num_prompt, num_tokens: [k] on logits' device; every row has at least one token). Repetition penalty over
    prompt and output tokens (logit > 0: / rp, else
    * rp), then logit -= frequency * count + presence * (count > 0) over output tokens. use_*: skip a
    term that is a no-op for every row (decided by the caller on the host)."""
    dev = logits.device
    toks = tokens
    pos = torch.arange(toks.shape[1], device=dev)[None, :]
    known = pos < num_tokens[:, None]
    # Work on the [k, length] entries of the row's own tokens rather than on [k, V]. Past num_tokens the
    # buffer holds stale tokens of earlier requests: point those entries at the row's first token, so every
    # entry naming the same token writes the same value and the scatters below are well defined.
    ids = torch.where(known, toks, toks[:, :1])
    if use_repetition:
        x = logits.gather(1, ids)
        rp = repetition[:, None]
        logits.scatter_(1, ids, torch.where(x > 0, x / rp, x * rp))
    if use_counts:
        is_out = known & (pos >= num_prompt[:, None])
        counts = torch.zeros_like(logits).scatter_add_(1, toks, is_out.to(logits.dtype)).gather(1, ids)
        x = logits.gather(1, ids)  # prompt-only tokens have count 0: written back unchanged
        logits.scatter_(
            1, ids, x - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(x.dtype)
        )
    return logits


def process_logits(logits: torch.Tensor, rows: list[int], state: RequestState) -> None:
    """In place on logits [len(rows), V] (row j belongs to request row rows[j]): penalties, then min_tokens
    suppression, each only for the rows that ask for it."""
    st = state
    if st.penalty_rows:
        sel = [j for j, r in enumerate(rows) if r in st.penalty_rows]
        if sel:
            rs = [rows[j] for j in sel]
            n_tok = [st.num_tokens[r] for r in rs]
            every = len(sel) == len(rows)
            # One non-blocking copy for every index list the step needs.
            rs_t, sel_t, n_prompt_t, n_tok_t = to_device(
                [rs, [] if every else sel, [st.num_prompt[r] for r in rs], n_tok], logits.device
            )
            sub = logits if every else logits[sel_t]
            apply_penalties_(
                sub,
                st.tokens[rs_t, : max(n_tok)],
                n_prompt_t,
                n_tok_t,
                st.repetition_penalty[rs_t],
                st.presence_penalty[rs_t],
                st.frequency_penalty[rs_t],
                use_repetition=any(st.repetition_penalty_cpu[r] != 1.0 for r in rs),
                use_counts=any(
                    st.presence_penalty_cpu[r] != 0.0 or st.frequency_penalty_cpu[r] != 0.0 for r in rs
                ),
            )
            if not every:
                logits[sel_t] = sub
    if st.min_tokens_rows:
        vocab = logits.shape[-1]
        ii: list[int] = []
        jj: list[int] = []
        for j, r in enumerate(rows):
            if r in st.min_tokens_rows and st.num_outputs(r) < st.min_tokens[r]:
                ids = [t for t in st.suppress_ids[r] if 0 <= t < vocab]
                ii += [j] * len(ids)
                jj += ids
        if ii:
            ii_t, jj_t = to_device([ii, jj], logits.device)
            logits[ii_t, jj_t] = float("-inf")

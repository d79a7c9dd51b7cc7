"""Prompt-lookup drafts in plain torch, found on the host (see kernels/triton/ngram_propose.py for what is
proposed). Finding the matches on the host, it also returns how many drafts each row really has (0
without a match): a CPU worker uses that to verify only real drafts."""

from __future__ import annotations

import torch


def propose_ngram_ref(
    tokens: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, k: int, min_n: int, max_n: int
) -> list[int]:
    """For each i: row = rows[i], L = lens[i] known tokens; writes tokens[row, L : L + k] (clipped to
    the buffer's width). Returns each row's number of matched drafts (0 where no n-gram matched)."""
    width = tokens.shape[1]
    found: list[int] = []
    for row, length in zip(rows.tolist(), lens.tolist()):
        seq = tokens[row, :length]
        src = _match_source(seq, length, min_n, max_n)
        n_out = max(0, min(k, width - length))
        found.append(n_out if src >= 0 else 0)
        if n_out == 0:
            continue
        if src < 0:
            drafts = seq[length - 1 :].expand(n_out)
        else:
            period = length - src  # seq[src:] continues like seq[length:] will
            idx = torch.arange(n_out, device=seq.device) + src
            idx = torch.where(idx < length, idx, length - period + (idx - length) % period)
            drafts = seq[idx]
        tokens[row, length : length + n_out] = drafts
    return found


def _match_source(seq: torch.Tensor, length: int, min_n: int, max_n: int) -> int:
    """Index of the token after the latest earlier occurrence of the longest matching suffix n-gram, or -1."""
    for n in range(max_n, min_n - 1, -1):
        if length <= n:
            continue
        # Windows starting at 0 .. length-1-n: each is followed by at least one known token.
        win = seq[: length - 1].unfold(0, n, 1)
        hits = (win == seq[length - n :]).all(dim=-1).nonzero()
        if hits.numel():
            return int(hits[-1]) + n
    return -1


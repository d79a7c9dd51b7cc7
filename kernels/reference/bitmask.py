"""Structured-output logit masking in plain torch (the CPU path, and what kernels/triton/bitmask.py is tested
against): set the logits of tokens a grammar disallows to -inf, in place.

The bitmask is xgrammar's layout: int32 [R, >= ceil(V/32)], token t of a row allowed iff bit t % 32 of word
t // 32 is set (words past ceil(V/32) are ignored). Row i of the bitmask masks logits row rows[i] (all of
logits row i when rows is None), so a batch mixing constrained and free requests ships masks only for the
constrained ones.
"""

from __future__ import annotations

import torch


def check_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> int:
    assert logits.dim() == 2 and bitmask.dim() == 2 and bitmask.dtype == torch.int32
    vocab = logits.shape[1]
    # A narrower mask would leave the tail of the vocab unmasked: samplable out-of-grammar tokens.
    assert bitmask.shape[1] * 32 >= vocab, f"bitmask covers {bitmask.shape[1] * 32} < {vocab} tokens"
    n = bitmask.shape[0] if rows is None else rows.numel()
    assert n <= bitmask.shape[0] and (rows is not None or n == logits.shape[0])
    return n


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (rows distinct)."""
    n = check_bitmask(logits, bitmask, rows)
    if n == 0:
        return
    vocab = logits.shape[1]
    words = bitmask[:n, : (vocab + 31) // 32]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(n, -1)[:, :vocab].bool()
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = rows.to(device=logits.device, dtype=torch.long)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


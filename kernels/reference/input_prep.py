"""Device-side input prep in plain torch (the CPU path, and what kernels/triton/input_prep.py is tested
against): a step's flat token arrays gathered from the persistent request state (the block table's update is
kernels/reference/scatter_2d.py)."""

from __future__ import annotations

import torch


def prepare_inputs_ref(
    tokens: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    cu_lens: torch.Tensor,
    total: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request i contributes lens[i] tokens at flat offsets cu_lens[i].. (cu_lens: exclusive prefix sum
    of lens, total = sum(lens)): input_ids = tokens[row, start + j], positions = start + j,
    out_cache_loc = req_to_token[row, start + j] for j < lens[i], with row = rows[i], start = starts[i]."""
    # output_size keeps repeat_interleave from reading the lengths back to the host.
    req_of_tok = torch.repeat_interleave(
        torch.arange(rows.numel(), device=rows.device), lens, output_size=total
    )
    positions = starts[req_of_tok] + torch.arange(total, device=rows.device) - cu_lens[req_of_tok]
    tok_rows = rows[req_of_tok]
    return tokens[tok_rows, positions], positions, req_to_token[tok_rows, positions]

"""Mixture-of-experts in plain torch: the router's top-k choice, the experts' SwiGLU products and the pairs
sorted by expert that the fused kernels work from. The path where neither fused kernel runs (bf16 on CPU,
CUDA without Triton), and what kernels/triton/moe.py and the C kernel (kernels/native/moe.py) are tested
against.

Shapes: x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2 [E, H, I]; a token's
experts ids [T, k] and their weights [T, k] (float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64): softmax over all experts
    in float32, the k largest, divided by their sum when `renormalize` (Mixtral; Qwen-MoE's
    norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) over token t's experts e = ids[t, j],
    expert by expert as transformers computes it (only the tokens routed to an expert go through it)."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = F.linear(x[tok], w13[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def sort_by_expert(ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs grouped by expert for a grouped product in blocks of `block` rows, from device
    ops of static shapes only (no host sync: a CUDA graph can hold it). Pair p is token p // k's slot p % k.

    Returns pair_ids [blocks * block]: each expert's pairs in order, its group padded up to a whole block
    with the sentinel T * k; and block_expert [blocks]: the expert of each block, -1 past the last group.
    `blocks` is an upper bound, T * k pairs plus the padding of at most min(E, T * k) non-empty groups."""
    flat = ids.reshape(-1).long()
    pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    # a pair's place within its expert's group: its sorted index minus the pairs of the experts before
    rank = torch.arange(pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    blocks = -(-(pairs + min(num_experts, pairs) * (block - 1)) // block)
    pair_ids = torch.full((blocks * block,), pairs, dtype=torch.int64, device=dev)
    pair_ids[(ends - padded)[expert_of] + rank] = order
    block_expert = torch.searchsorted(ends, torch.arange(blocks, device=dev) * block, right=True)
    return pair_ids, torch.where(block_expert < num_experts, block_expert, -1)


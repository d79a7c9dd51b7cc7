"""Logprobs of sampled and prompt tokens: log_softmax of the RAW model logits (before penalties and
temperature, vLLM's default "raw logprobs"), the chosen token's value and the top-N at each position."""

from __future__ import annotations

import torch

from tandem.protocol.messages import Logprobs
from tandem.worker.input_prep import PromptLogprobsPlan


def log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """In place: the logits are not needed afterwards, and [positions, vocab] can be large for prompts."""
    return x.sub_(x.logsumexp(dim=-1, keepdim=True))


def _gather(
    logp: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Host lists: the chosen tokens' logprobs, and the top_n (ids, logprobs) per row, descending."""
    chosen = logp.gather(-1, token_ids.view(-1, 1)).squeeze(-1).tolist()
    if top_n <= 0:
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    vals, ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
    return chosen, ids.tolist(), vals.tolist()


def sampled_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, top_ns: list[int]) -> list[Logprobs]:
    """raw_logits [k, V] (consumed), the sampled token_ids [k], top-N per row -> one Logprobs per row."""
    chosen, ids, vals = _gather(log_softmax_(raw_logits), token_ids, max(top_ns))
    toks = token_ids.tolist()
    return [
        Logprobs([t], [c], [i[:n]], [v[:n]])
        for t, c, i, v, n in zip(toks, chosen, ids, vals, top_ns, strict=True)
    ]


def prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobsPlan) -> dict[int, Logprobs]:
    """logits [sum(plan.counts), V] (consumed) at the planned positions -> request row -> Logprobs."""
    chosen, ids, vals = _gather(log_softmax_(logits), plan.targets, max(plan.top_ns))
    targets = plan.targets.tolist()
    out: dict[int, Logprobs] = {}
    a = 0
    for r, c, n in zip(plan.rows, plan.counts, plan.top_ns, strict=True):
        b = a + c
        out[r] = Logprobs(targets[a:b], chosen[a:b], [i[:n] for i in ids[a:b]], [v[:n] for v in vals[a:b]])
        a = b
    return out

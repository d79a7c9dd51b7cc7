"""Token sampling (greedy / temperature + top-k + top-p + min-p) and logprobs.

Sampling uses the exponential race: token = argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d., which draws
token i with probability p_i. Each seeded request draws its own vocab-sized E from its own generator, so
its tokens depend only on its logits and its seed -- not on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _as_list(x: torch.Tensor | Sequence[float] | Sequence[int]) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | Sequence[float],
    top_k: torch.Tensor | Sequence[int],
    top_p: torch.Tensor | Sequence[float],
    min_p: torch.Tensor | Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64.

    temperature <= 0: greedy. top_k <= 0 or >= V: off. top_p >= 1: off. min_p <= 0: off.
    The per-row parameters are read on the host (one small copy if they live on the device).
    """
    b, vocab = logits.shape
    temps = _as_list(temperature)
    ks_all = [int(k) for k in _as_list(top_k)]
    # top_k == 1 is greedy by definition; taking argmax also gets ties right (lowest index).
    greedy = [t <= 0 or k == 1 for t, k in zip(temps, ks_all, strict=True)]
    if all(greedy):
        return logits.argmax(dim=-1)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    g_rows = [i for i in range(b) if greedy[i]]
    s_rows = [i for i in range(b) if not greedy[i]]
    dev = logits.device
    if g_rows:
        g_idx = torch.tensor(g_rows, device=dev)
        out[g_idx] = logits[g_idx].argmax(dim=-1)

    s_idx = torch.tensor(s_rows, device=dev)
    ks = ks_all
    ps = [float(p) for p in _as_list(top_p)]
    mps = [float(m) for m in _as_list(min_p)]
    ks = [ks[i] if 0 < ks[i] < vocab else vocab for i in s_rows]
    ps = [ps[i] for i in s_rows]
    mps = [mps[i] for i in s_rows]

    x = logits[s_idx] / torch.tensor([temps[i] for i in s_rows], device=dev, dtype=logits.dtype)[:, None]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
        x = _top_k_top_p(x, ks, ps)
    probs = x.softmax(dim=-1)
    if any(m > 0 for m in mps):
        # min-p: keep tokens with p >= min_p * p_max (scale-free, so renormalising first changes nothing).
        thresh = probs.amax(dim=-1, keepdim=True) * torch.tensor(mps, device=dev, dtype=probs.dtype)[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)

    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(s_rows) if generators[i] is None]
    if len(shared) == len(s_rows):
        noise.exponential_()
    else:
        if shared:
            sh = torch.tensor(shared, device=dev)
            noise[sh] = torch.empty(len(shared), vocab, device=dev, dtype=probs.dtype).exponential_()
        for j, i in enumerate(s_rows):
            if generators[i] is not None:
                noise[j].exponential_(generator=generators[i])
    # Clamp: an exact 0 draw would make 0/0 = NaN for a filtered token, and argmax picks NaN.
    out[s_idx] = (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return out


def _top_k_top_p(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus (of the top-k renormalised),
    to -inf. The highest-ranked token always survives."""
    vocab = x.shape[-1]
    kmax = max(ks)
    if all(p >= 1.0 for p in ps) and kmax <= 1024 and kmax < vocab:
        # top-k only: a partial top-k is much cheaper than sorting the whole vocabulary.
        vals, idx = x.topk(kmax, dim=-1)
        drop = torch.arange(kmax, device=x.device)[None, :] >= torch.tensor(ks, device=x.device)[:, None]
        return torch.full_like(x, float("-inf")).scatter_(-1, idx, vals.masked_fill(drop, float("-inf")))
    # Stable sort: among equal logits the lowest index ranks first, as with argmax.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(x.shape[-1], device=x.device)
    drop = rank[None, :] >= torch.tensor(ks, device=x.device)[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    if any(p < 1.0 for p in ps):
        probs = sorted_x.softmax(dim=-1)
        # Mass strictly before each token; keep while it is < top_p -> smallest prefix reaching top_p.
        before = probs.cumsum(dim=-1) - probs
        # Rows without top-p get an infinite threshold: rounding can push the running sum past 1.0.
        thr = torch.tensor([p if p < 1.0 else float("inf") for p in ps], device=x.device, dtype=probs.dtype)
        drop = before >= thr[:, None]
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of the (unprocessed) logits [B, V]: the chosen tokens' logprobs [B], and the top_n
    (ids [B, top_n] int64, logprobs [B, top_n]) in descending order."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, token_ids.view(-1, 1).to(torch.int64)).squeeze(-1)
    if top_n <= 0:
        empty = logp.new_empty(logp.shape[0], 0)
        return chosen, empty.to(torch.int64), empty
    top_vals, top_ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
    return chosen, top_ids, top_vals

"""Token sampling (greedy / temperature + top-k + top-p + min-p) and logprobs.

Sampling uses the exponential race: token = argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d., which draws
token i with probability p_i. Each seeded request draws its own vocab-sized E from its own generator, so
its tokens depend only on its logits and its seed -- not on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.sampling_params import GREEDY_BELOW_TEMPERATURE

# Partial top-k size tried before falling back to a full sort of the vocabulary for top-k / top-p.
TOP_CANDIDATES = 1024


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

    temperature < GREEDY_BELOW_TEMPERATURE: greedy. top_k <= 0 or >= V: off. top_p >= 1: off. min_p <= 0: off.
    The per-row parameters are read on the host (one small copy if they live on the device).
    """
    b, vocab = logits.shape
    temps = _as_list(temperature)
    ks_all = [int(k) for k in _as_list(top_k)]
    # top_k == 1 is greedy by definition; taking argmax also gets ties right (lowest index).
    greedy = [t < GREEDY_BELOW_TEMPERATURE or k == 1 for t, k in zip(temps, ks_all, strict=True)]
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
    filt = [j for j, (k, p) in enumerate(zip(ks, ps, strict=True)) if k < vocab or p < 1.0]
    if len(filt) == len(ks):
        x = _top_k_top_p(x, ks, ps)
    elif filt:
        f_idx = torch.tensor(filt, device=dev)
        x[f_idx] = _top_k_top_p(x[f_idx], [ks[j] for j in filt], [ps[j] for j in filt])
    probs = x.softmax(dim=-1)
    if any(m > 0 for m in mps):
        # min-p: keep tokens with p >= min_p * p_max (scale-free, so renormalising first changes nothing).
        thresh = probs.amax(dim=-1, keepdim=True) * torch.tensor(mps, device=dev, dtype=probs.dtype)[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)

    # Exp(1) noise as -log(U): several times faster than exponential_() on CPU. U in [0, 1) gives
    # E in (0, inf]; E = inf only zeroes that token's score, so no 0/0 can arise.
    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(s_rows) if generators[i] is None]
    if len(shared) == len(s_rows):
        noise.uniform_()
    else:
        if shared:
            noise[torch.tensor(shared, device=dev)] = torch.rand(
                len(shared), vocab, device=dev, dtype=probs.dtype
            )
        for j, i in enumerate(s_rows):
            if generators[i] is not None:
                noise[j].uniform_(generator=generators[i])
    out[s_idx] = (probs / noise.log_().neg_()).argmax(dim=-1)
    return out


def _top_k_top_p(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus (of the top-k renormalised),
    to -inf. The highest-ranked token always survives. ks: k per row, vocab size when off; every row
    must use top-k or top-p."""
    vocab, dev = x.shape[-1], x.device
    k_t = torch.tensor(ks, device=dev)[:, None]
    p_t = torch.tensor([p if p < 1.0 else float("inf") for p in ps], device=dev, dtype=x.dtype)[:, None]
    n = min(max(ks), TOP_CANDIDATES)
    if n < vocab and all(k <= n or (k == vocab and p < 1.0) for k, p in zip(ks, ps, strict=True)):
        # Sorting the whole vocabulary is slow on CPU; the top `n` usually hold every surviving token.
        vals, idx = x.topk(n, dim=-1)
        full_lse = x.logsumexp(dim=-1, keepdim=True) if any(k == vocab for k in ks) else None
        kept = _filter_sorted(vals, k_t, p_t, full_lse)
        if kept is not None:
            return torch.full_like(x, float("-inf")).scatter_(-1, idx, kept)
    # Stable sort: among equal logits the lowest index ranks first, as with argmax.
    vals, idx = x.sort(dim=-1, descending=True, stable=True)
    kept = _filter_sorted(vals, k_t, p_t, None)
    assert kept is not None
    return torch.full_like(x, float("-inf")).scatter_(-1, idx, kept)


def _filter_sorted(
    vals: torch.Tensor, k_t: torch.Tensor, p_t: torch.Tensor, full_lse: torch.Tensor | None
) -> torch.Tensor | None:
    """vals: each row's top logits, descending (all of them when full_lse is None, else a prefix and
    full_lse is the log-normaliser of the whole row). Returns vals with dropped entries at -inf, or
    None when some row's nucleus reaches past the prefix."""
    n = vals.shape[-1]
    vals = vals.masked_fill(torch.arange(n, device=vals.device)[None, :] >= k_t, float("-inf"))
    if not bool(torch.isfinite(p_t).any()):
        return vals
    lse = vals.logsumexp(dim=-1, keepdim=True)  # normaliser of the top-k set ...
    if full_lse is not None:  # ... unless top-k is off and the set is the whole row
        lse = torch.where(k_t > n, full_lse, lse)
    probs = (vals - lse).exp()
    cum = probs.cumsum(dim=-1)
    if full_lse is not None and bool(((cum[:, -1:] < p_t) & (k_t > n)).any()):
        return None
    # Mass strictly before each token; keep while it is < top_p -> smallest prefix reaching top_p.
    # Rows without top-p have an infinite threshold (rounding can push the running sum past 1.0).
    drop = (cum - probs) >= p_t
    drop[:, 0] = False
    return vals.masked_fill(drop, float("-inf"))


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

"""Token sampling (greedy / temperature + top-k + top-p + min-p) and logprobs.

Sampling uses the exponential race: token = argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d., which draws
token i with probability p_i. Each seeded request draws its own vocab-sized E from its own generator, so
its tokens depend only on its logits and its seed -- not on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.protocol.sampling_params import GREEDY_BELOW_TEMPERATURE

# Partial top-k size tried before falling back to a full sort of the vocabulary for top-k / top-p.
TOP_CANDIDATES = 1024


@dataclass(frozen=True)
class DeviceParams:
    """The sampling rows' parameters on the logits' device, [B] each: in the worker, gathered by row from
    the tensors RequestState wrote when each request was added, so a step copies none of them."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32


def _as_list(x: torch.Tensor | Sequence[float] | Sequence[int]) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | Sequence[float],
    top_k: torch.Tensor | Sequence[int],
    top_p: torch.Tensor | Sequence[float],
    min_p: torch.Tensor | Sequence[float],
    generators: Sequence[torch.Generator | None],
    device_params: DeviceParams | None = None,
) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] int64.

    temperature < GREEDY_BELOW_TEMPERATURE: greedy. top_k <= 0 or >= V: off. top_p >= 1: off. min_p <= 0: off.
    The host values (lists, or CPU tensors) decide which steps run; the arithmetic uses `device_params`
    (built from the host values when not given). With both given, nothing is copied to or read back from
    the device, so on CUDA the step is queued without a sync.
    """
    b = logits.shape[0]
    greedy = _greedy_rows(temperature, top_k)
    if all(greedy):
        return logits.argmax(dim=-1)
    probs, is_greedy = _probs(logits, greedy, temperature, top_k, top_p, min_p, device_params)
    # Exp(1) noise as -log(U): several times faster than exponential_() on CPU. U in [0, 1) gives
    # E in (0, inf]; E = inf only zeroes that token's score, so no 0/0 can arise.
    noise = torch.empty_like(probs).uniform_()
    for j in range(b):
        if generators[j] is not None and not greedy[j]:
            noise[j].uniform_(generator=generators[j])  # a seeded row draws from its own generator only
    out = (probs / noise.log_().neg_()).argmax(dim=-1)
    return out if is_greedy is None else torch.where(is_greedy, logits.argmax(dim=-1), out)


def sampling_probs(
    logits: torch.Tensor, temps: list[float], ks: list[int], ps: list[float], mps: list[float]
) -> torch.Tensor:
    """The distribution sample() draws a non-greedy row from: logits [B, V] with temperature, top-k, top-p
    and min-p as in sample() -> probabilities [B, V], normalised. Speculative decoding's rejection rule
    needs it explicitly (worker/spec_verify.py). Greedy rows get their unfiltered softmax."""
    return _probs(logits, _greedy_rows(temps, ks), temps, ks, ps, mps, None)[0]


def greedy_row(temperature: float, top_k: int) -> bool:
    """Whether a row samples greedily: top_k == 1 is greedy by definition; taking argmax also gets ties right
    (lowest index)."""
    return float(temperature) < GREEDY_BELOW_TEMPERATURE or int(top_k) == 1


def _greedy_rows(
    temperature: torch.Tensor | Sequence[float], top_k: torch.Tensor | Sequence[int]
) -> list[bool]:
    return [greedy_row(t, k) for t, k in zip(_as_list(temperature), _as_list(top_k), strict=True)]


def _probs(
    logits: torch.Tensor, greedy: list[bool], temperature: torch.Tensor | Sequence[float],
    top_k: torch.Tensor | Sequence[int], top_p: torch.Tensor | Sequence[float],
    min_p: torch.Tensor | Sequence[float], dp: DeviceParams | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one path from logits to the filtered distribution (temperature, top-k, top-p, min-p, then
    normalised), and the device mask of the greedy rows (None when there are none). Greedy rows are
    computed like the rest with the filters off (no host-built row subsets); callers take their argmax."""
    vocab, dev = logits.shape[-1], logits.device
    ks = [int(k) for k in _as_list(top_k)]
    ps = [float(p) for p in _as_list(top_p)]
    mps = [float(m) for m in _as_list(min_p)]
    dp = dp or DeviceParams(
        torch.tensor([float(t) for t in _as_list(temperature)], device=dev), torch.tensor(ks, device=dev),
        torch.tensor(ps, device=dev), torch.tensor(mps, device=dev),
    )
    is_greedy = (dp.temperature < GREEDY_BELOW_TEMPERATURE) | (dp.top_k == 1) if any(greedy) else None
    temp_t = dp.temperature if is_greedy is None else dp.temperature.masked_fill(is_greedy, 1.0)
    x = logits / temp_t.to(logits.dtype)[:, None]
    # Host view of the filters: greedy and unfiltered rows count as "top-k = vocab, top-p off".
    ks_h = [vocab if g or not 0 < k < vocab else k for k, g in zip(ks, greedy, strict=True)]
    ps_h = [1.0 if g else p for p, g in zip(ps, greedy, strict=True)]
    if any(k < vocab or p < 1.0 for k, p in zip(ks_h, ps_h, strict=True)):
        k_t = dp.top_k.masked_fill((dp.top_k <= 0) | (dp.top_k >= vocab), vocab)
        p_t = dp.top_p
        if is_greedy is not None:
            k_t, p_t = k_t.masked_fill(is_greedy, vocab), p_t.masked_fill(is_greedy, 1.0)
        x = _top_k_top_p(x, ks_h, ps_h, k_t, p_t)
    probs = x.softmax(dim=-1)
    if any(m > 0 and not g for m, g in zip(mps, greedy, strict=True)):
        # min-p: keep tokens with p >= min_p * p_max (scale-free, so renormalising first changes nothing).
        min_p_t = dp.min_p if is_greedy is None else dp.min_p.masked_fill(is_greedy, 0.0)
        thresh = probs.amax(dim=-1, keepdim=True) * min_p_t.to(probs.dtype)[:, None]
        probs = probs.masked_fill(probs < thresh, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, is_greedy


def _top_k_top_p(
    x: torch.Tensor, ks: list[int], ps: list[float], k_t: torch.Tensor | None = None,
    p_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus (of the top-k renormalised),
    to -inf. The highest-ranked token always survives. ks: k per row, vocab size when off; ps: 1.0 when
    off. k_t, p_t: the same on x's device (built from ks, ps when not given)."""
    vocab, dev = x.shape[-1], x.device
    k_t = (torch.tensor(ks, device=dev) if k_t is None else k_t)[:, None]
    p_t = (torch.tensor(ps, device=dev) if p_t is None else p_t).to(x.dtype)
    # Rows without top-p get an infinite threshold (rounding can push the running sum past 1.0).
    p_t = p_t.masked_fill(p_t >= 1.0, float("inf"))[:, None]
    use_p = any(p < 1.0 for p in ps)
    p_only = [k == vocab and p < 1.0 for k, p in zip(ks, ps, strict=True)]
    n = min(max(ks), TOP_CANDIDATES)
    # A top-p-only row may reach past the top n, which only a device read can tell: on CUDA such
    # batches sort in full (fast there) rather than wait for the host.
    if n < vocab and all(k <= n or po for k, po in zip(ks, p_only, strict=True)) and not (
        x.is_cuda and any(p_only)
    ):
        # Sorting the whole vocabulary is slow on CPU; the top `n` usually hold every surviving token.
        vals, idx = x.topk(n, dim=-1)
        full_lse = x.logsumexp(dim=-1, keepdim=True) if any(p_only) else None
        kept = _filter_sorted(vals, k_t, p_t, full_lse, use_p)
        if kept is not None:
            return torch.full_like(x, float("-inf")).scatter_(-1, idx, kept)
    # Stable sort: among equal logits the lowest index ranks first, as with argmax.
    vals, idx = x.sort(dim=-1, descending=True, stable=True)
    kept = _filter_sorted(vals, k_t, p_t, None, use_p)
    assert kept is not None
    return torch.full_like(x, float("-inf")).scatter_(-1, idx, kept)


def _filter_sorted(
    vals: torch.Tensor, k_t: torch.Tensor, p_t: torch.Tensor, full_lse: torch.Tensor | None, use_p: bool
) -> torch.Tensor | None:
    """vals: each row's top logits, descending (all of them when full_lse is None, else a prefix and
    full_lse is the log-normaliser of the whole row). Returns vals with dropped entries at -inf, or
    None when some row's nucleus reaches past the prefix."""
    n = vals.shape[-1]
    vals = vals.masked_fill(torch.arange(n, device=vals.device)[None, :] >= k_t, float("-inf"))
    if not use_p:
        return vals
    lse = vals.logsumexp(dim=-1, keepdim=True)  # normaliser of the top-k set ...
    if full_lse is not None:  # ... unless top-k is off and the set is the whole row
        lse = torch.where(k_t > n, full_lse, lse)
    probs = (vals - lse).exp()
    cum = probs.cumsum(dim=-1)
    if full_lse is not None and bool(((cum[:, -1:] < p_t) & (k_t > n)).any()):
        return None
    # Mass strictly before each token; keep while it is < top_p -> smallest prefix reaching top_p.
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

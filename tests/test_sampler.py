"""Sampler: greedy, top-k / top-p / min-p support, seeded reproducibility, logprobs; logits processing
(repetition / presence / frequency penalties, min_tokens) against plain reference loops."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tandem.kernels.ops import resolve_ops
from tandem.protocol.messages import NewReqData, ScheduledReq, WorkerSampling
from tandem.worker.input_prep import advance_state
from tandem.worker.penalties import process_logits
from tandem.worker.request_state import RequestState
from tandem.worker.sampler import _top_k_top_p, compute_logprobs, sample, sampling_probs

V = 100


def _params(b: int, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0):
    return (
        torch.full((b,), temperature),
        torch.full((b,), top_k, dtype=torch.int64),
        torch.full((b,), top_p),
        torch.full((b,), min_p),
    )


def _known_dist(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits whose softmax is [0.5, 0.2, 0.15, 0.1, 0.05 - tail, tail...] on a shuffled vocabulary.
    Returns (logits [V], token ids ordered by probability)."""
    probs = torch.full((V,), 0.01 / (V - 5))
    probs[:5] = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.04])
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
    logits = torch.empty(V)
    logits[perm] = probs.log()
    return logits, perm


def _draw(logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    torch.manual_seed(123)  # unseeded rows use the global generator
    return sample(logits.expand(n, V).contiguous(), *_params(n, **kw), [None] * n)


def test_greedy_is_argmax_with_lowest_index_ties() -> None:
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(0))
    logits[3, 7] = logits[3, 50] = logits[3].max() + 1.0  # tie: the lower index wins
    out = sample(logits, *_params(16, temperature=0.0), [None] * 16)
    assert torch.equal(out, logits.argmax(-1)) and out[3] == 7
    out_k1 = sample(logits, *_params(16, temperature=0.7, top_k=1), [torch.Generator()] * 16)
    assert torch.equal(out_k1, out)
    # A temperature too small to divide by (logits / 1e-9 overflows to inf) is greedy too.
    out_tiny = sample(logits * 1e4, *_params(16, temperature=1e-9), [torch.Generator()] * 16)
    assert torch.equal(out_tiny, out)


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    temp = torch.tensor([0.0, 1.0, 0.0, 0.8, 1.2, 0.0])
    out = sample(logits, temp, *_params(6)[1:], [None] * 6)
    greedy = temp == 0
    assert torch.equal(out[greedy], logits[greedy].argmax(-1))
    assert out.dtype == torch.int64 and ((out >= 0) & (out < V)).all()


def test_plain_sampling_frequencies_follow_softmax() -> None:
    logits, order = _known_dist()
    for temperature in (1.0, 0.5):
        counts = torch.bincount(_draw(logits, 20000, temperature=temperature), minlength=V).float()
        expected = (logits / temperature).softmax(-1)
        assert (counts / counts.sum() - expected).abs().max() < 0.015


@pytest.fixture(params=[4, 1024], ids=["partial-topk", "full-sort"])
def candidates(request, monkeypatch: pytest.MonkeyPatch) -> int:
    """Run top-k/top-p tests both through the partial top-k path and the full-sort path."""
    monkeypatch.setattr("tandem.worker.sampler.TOP_CANDIDATES", request.param)
    return request.param


def test_top_k_support(candidates: int) -> None:
    logits, order = _known_dist(1)
    out = _draw(logits, 5000, top_k=3)
    assert set(out.tolist()) == set(order[:3].tolist())
    freq = torch.bincount(out, minlength=V).float()[order[:3]] / 5000
    assert (freq - torch.tensor([0.5, 0.2, 0.15]) / 0.85).abs().max() < 0.03


def test_unfiltered_rows_next_to_filtered_rows_keep_full_support(candidates: int) -> None:
    logits, order = _known_dist(4)
    n = 4000
    temp, top_k, top_p, min_p = _params(n)
    top_k[0::2] = 2
    torch.manual_seed(0)
    out = sample(logits.expand(n, V).contiguous(), temp, top_k, top_p, min_p, [None] * n)
    assert set(out[0::2].tolist()) == set(order[:2].tolist())
    assert len(set(out[1::2].tolist())) > 5  # the 5th-ranked token alone has p = 0.04


def test_top_p_support(candidates: int) -> None:
    logits, order = _known_dist(2)
    # cumulative mass 0.5, 0.7, 0.85: the smallest prefix reaching 0.8 is the top 3 tokens
    assert set(_draw(logits, 5000, top_p=0.8).tolist()) == set(order[:3].tolist())
    assert set(_draw(logits, 2000, top_p=0.45).tolist()) == {int(order[0])}  # top-1 always kept
    # top-k first, then top-p over the renormalised top-k: [0.5, 0.2]/0.7 -> 0.71 < 0.9, keep both
    assert set(_draw(logits, 2000, top_k=2, top_p=0.9).tolist()) == set(order[:2].tolist())
    assert set(_draw(logits, 2000, top_k=4, top_p=0.6).tolist()) == set(order[:2].tolist())
    # nucleus of 5 tokens (mass before the 5th: 0.95 < 0.97): more than 4 candidates, falls back to a sort
    assert set(_draw(logits, 5000, top_p=0.97).tolist()) == set(order[:5].tolist())


def test_partial_and_full_filtering_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(9)
    vocab = 3000
    x = torch.randn(32, vocab, generator=g) * 3
    ks = [int(k) for k in torch.randint(1, 50, (32,), generator=g)]
    ks = [vocab if i % 3 == 0 else k for i, k in enumerate(ks)]
    ps = [float(p) for p in torch.rand(32, generator=g) * 0.4 + 0.5]
    ps = [1.0 if i % 4 == 1 and ks[i] < vocab else p for i, p in enumerate(ps)]  # every row filters
    partial = torch.isfinite(_top_k_top_p(x, ks, ps))
    monkeypatch.setattr("tandem.worker.sampler.TOP_CANDIDATES", vocab)
    assert torch.equal(partial, torch.isfinite(_top_k_top_p(x, ks, ps)))


def test_min_p_support() -> None:
    logits, order = _known_dist(3)
    # threshold = min_p * 0.5: 0.175 keeps {0.5, 0.2}; 0.09 keeps down to 0.1
    assert set(_draw(logits, 5000, min_p=0.35).tolist()) == set(order[:2].tolist())
    assert set(_draw(logits, 5000, min_p=0.18).tolist()) == set(order[:4].tolist())


def test_seeded_rows_ignore_batch_composition() -> None:
    g = torch.Generator().manual_seed(5)
    target = torch.randn(V, generator=g)
    others = torch.randn(5, V, generator=g)

    def run(position: int, batch_size: int, steps: int = 8) -> list[int]:
        gens = [torch.Generator().manual_seed(s) for s in range(100, 100 + batch_size)]
        gens[position] = torch.Generator().manual_seed(42)
        if batch_size > 2:
            gens[(position + 1) % batch_size] = None  # an unseeded neighbour
        rows = [others[i % 5] for i in range(batch_size)]
        rows[position] = target
        logits = torch.stack(rows)
        temp, top_k, top_p, min_p = _params(batch_size, temperature=0.9)
        temp[(position + 2) % batch_size] = 0.0 if batch_size > 2 else temp[0]
        top_k[(position + 3) % batch_size] = 5 if batch_size > 3 else -1
        top_p[position] = 0.95
        return [int(sample(logits, temp, top_k, top_p, min_p, gens)[position]) for _ in range(steps)]

    alone = run(0, 1)
    assert run(2, 4) == alone
    assert run(4, 5) == alone
    assert run(0, 3) == alone


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, V)  # uniform: 20 draws from two seeds colliding everywhere is ~impossible

    def draws(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [int(sample(logits, *_params(1), [gen])[0]) for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_compute_logprobs() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6)) * 3
    tokens = torch.tensor([0, 5, 99, 42])
    chosen, top_ids, top_lp = compute_logprobs(logits, tokens, top_n=5)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(chosen, ref[torch.arange(4), tokens])
    ref_vals, ref_ids = ref.topk(5, dim=-1)
    assert torch.equal(top_ids, ref_ids)
    torch.testing.assert_close(top_lp, ref_vals)
    _, ids0, lp0 = compute_logprobs(logits, tokens, top_n=0)
    assert ids0.shape == (4, 0) and lp0.shape == (4, 0)


def _ws(**kw: object) -> WorkerSampling:
    return WorkerSampling(**{"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "seed": None, **kw})


def _ref_penalties(
    logits: list[float], prompt: list[int], outputs: list[int], rp: float, presence: float, frequency: float
) -> list[float]:
    """vLLM's penalties, written plainly."""
    x = list(logits)
    for t in range(len(x)):
        if t in prompt or t in outputs:
            x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    for t in range(len(x)):
        count = sum(1 for o in outputs if o == t)
        x[t] -= frequency * count + (presence if count > 0 else 0.0)
    return x


def test_penalties_match_reference_and_leave_other_rows_alone() -> None:
    g = torch.Generator().manual_seed(11)
    st = RequestState(max_reqs=10, max_context=64, device=torch.device("cpu"))
    st.tokens.random_(0, V, generator=g)  # stale tokens past each row's end must not count
    # (row, repetition, presence, frequency); rows 2 and 7 use no penalty.
    cases = [
        (1, 1.3, 0.0, 0.0), (2, 1.0, 0.0, 0.0), (4, 1.0, 0.6, 0.0), (5, 1.0, 0.0, 0.9),
        (6, 0.7, -0.4, 1.5), (7, 1.0, 0.0, 0.0), (9, 2.0, 1.0, -0.5),
    ]
    seqs = {}
    for row, rp, pres, freq in cases:
        n_prompt, n_out = (int(x) for x in torch.randint(1, 20, (2,), generator=g))
        # A small alphabet, so tokens repeat and counts exceed 1.
        toks = torch.randint(0, 12, (n_prompt + n_out,), generator=g).tolist()
        seqs[row] = (toks[:n_prompt], toks[n_prompt:])
        sampling = _ws(repetition_penalty=rp, presence_penalty=pres, frequency_penalty=freq)
        st.add(NewReqData(row, toks, n_prompt, 0, sampling))
    rows = [r for r, *_ in cases]
    logits = torch.randn(len(rows), V, generator=g) * 3
    logits[:, :12] = torch.randn(len(rows), 12, generator=g)  # both signs among the repeated tokens
    logits[:, 3] = 0.0
    out = logits.clone()
    process_logits(out, rows, st)
    for j, (row, rp, pres, freq) in enumerate(cases):
        if (rp, pres, freq) == (1.0, 0.0, 0.0):
            assert torch.equal(out[j], logits[j])
        else:
            ref = _ref_penalties(logits[j].tolist(), *seqs[row], rp, pres, freq)
            torch.testing.assert_close(out[j], torch.tensor(ref), atol=1e-5, rtol=1e-6)
            assert not torch.equal(out[j], logits[j])


def test_min_tokens_suppresses_until_reached() -> None:
    st = RequestState(max_reqs=4, max_context=32, device=torch.device("cpu"))
    suppress = [5, 17, V + 3]  # an id past the logits' width is ignored
    st.add(NewReqData(1, [1, 2, 3], 3, 0, _ws(min_tokens=3, suppress_ids=suppress)))
    st.add(NewReqData(3, [4, 5], 2, 0, _ws()))
    sched = [ScheduledReq(1, 3, 0, [], True), ScheduledReq(3, 2, 0, [], True)]
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(12))
    logits[:, 17] = 50.0  # the argmax: greedy would pick it if it were not suppressed
    for k in range(5):  # k outputs so far
        out = logits.clone()
        process_logits(out, [1, 3], st)
        suppressed = k < 3
        assert bool(torch.isinf(out[0, [5, 17]]).all()) == suppressed
        keep = torch.ones(V, dtype=torch.bool)
        keep[[5, 17]] = False
        assert torch.equal(out[0, keep], logits[0, keep]) and torch.equal(out[1], logits[1])
        tokens = sample(out, *_params(2, temperature=0.0), [None, None])
        assert (int(tokens[0]) != 17) == suppressed and int(tokens[1]) == 17
        advance_state(sched, st, resolve_ops("cpu", torch.float32), [int(tokens[0]), 8])
        sched = [ScheduledReq(1, 1, 0, [], True), ScheduledReq(3, 1, 0, [], True)]


def test_default_rows_skip_processing() -> None:
    st = RequestState(max_reqs=4, max_context=16, device=torch.device("cpu"))
    st.add(NewReqData(0, [1, 2], 2, 0, _ws(min_tokens=0, suppress_ids=[1])))
    st.add(NewReqData(1, [1, 2], 2, 0, _ws(min_tokens=5)))  # no ids to suppress: nothing to do
    assert not (st.penalty_rows or st.min_tokens_rows or st.logprob_rows or st.prompt_logprob_rows)
    st.add(NewReqData(2, [1, 2], 2, 0, _ws(frequency_penalty=0.1, logprobs=0, prompt_logprobs=2)))
    assert st.penalty_rows == st.logprob_rows == st.prompt_logprob_rows == {2}
    st.free(2)
    assert not (st.penalty_rows or st.logprob_rows or st.prompt_logprob_rows)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 20, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (1.0, 30, 0.9, 0.02), (0.9, -1, 1.0, 0.05)],
)
def test_sample_draws_from_sampling_probs(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """The distribution speculative decoding verifies against (sampling_probs) is the one sample() draws
    from: 20,000 draws of one row, beside a greedy row, fit it (chi-square) and never leave its support."""
    n = 20_000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2
    probs = sampling_probs(logits[None], [temperature], [top_k], [top_p], [min_p])[0]
    batch = logits.expand(n + 1, V).clone()
    params = [list(x) for x in _params(n + 1, temperature, top_k, top_p, min_p)]
    params[0][0] = 0.0  # row 0 greedy: its argmax, whatever the filters of the others
    tokens = sample(batch, *params, [None] * (n + 1))
    assert int(tokens[0]) == int(logits.argmax())
    observed = torch.bincount(tokens[1:], minlength=V).double()
    assert observed[probs == 0].sum() == 0
    expected = probs.double() * n
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if expected[~big].sum() > 0:  # the rarely drawn tokens pooled into one bin
        obs = torch.cat([obs, observed[~big].sum()[None]])
        exp = torch.cat([exp, expected[~big].sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 0.01

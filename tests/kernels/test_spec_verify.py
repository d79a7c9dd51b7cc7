"""Draft verification on the worker: greedy acceptance is the longest prefix equal to the argmax, and
the rejection rule leaves a tiny model's distribution at a position exactly as it was (chi-square
over 20,000 seeded draws with a forced draft the model likes, and one it does not)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tandem.worker.spec_verify import verify
from tests.reference import hf_model

N_DRAWS = 20_000


def _greedy_args(b: int) -> tuple[list[float], list[int], list[float], list[float]]:
    return [0.0] * b, [-1] * b, [1.0] * b, [0.0] * b


def test_greedy_accepts_the_longest_matching_prefix_plus_one() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 50, generator=g)  # K = 4
    target = logits.argmax(-1)
    drafts = target[:, :4].clone()
    drafts[0, 0] += 1  # wrong at once: 0 accepted
    drafts[1, 2] += 1  # 2 accepted
    # row 2: all 4 right; row 3: all right but only 3 of its drafts are real (padding past them)
    drafts[3, 3] += 1
    nd = torch.tensor([4, 4, 4, 3])
    out, counts = verify(logits, drafts, nd, *_greedy_args(4), lambda b, j: None)
    assert counts.tolist() == [1, 3, 5, 4]
    for b, c in enumerate(counts.tolist()):
        assert out[b, :c].tolist() == target[b, :c].tolist()


def _target_logits(tiny_model) -> torch.Tensor:
    model = hf_model(tiny_model("llama"))
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 300, 42, 9]])).logits[0, -2:].float()
    return logits  # [2, V]: the draft's position and the bonus position after it


@pytest.mark.parametrize("which", ["liked", "disliked"])
def test_rejection_rule_keeps_the_target_distribution(tiny_model, which: str) -> None:
    temperature = 1.0
    logits = _target_logits(tiny_model)
    p = (logits[0] / temperature).softmax(-1)
    order = p.argsort(descending=True)
    draft = int(order[0]) if which == "liked" else int(order[40])
    assert (p[draft] > 0.2) if which == "liked" else (1e-4 < p[draft] < 0.02)
    firsts = []
    accepted = 0
    chunk = 2_000
    for start in range(0, N_DRAWS, chunk):
        gens = [torch.Generator() for _ in range(chunk)]

        def gen(b: int, j: int, start: int = start, gens: list = gens) -> torch.Generator:
            return gens[b].manual_seed(1_000_003 * (start + b) + j)

        out, counts = verify(
            logits.expand(chunk, 2, -1), torch.full((chunk, 1), draft), torch.ones(chunk, dtype=torch.int64),
            [temperature] * chunk, [-1] * chunk, [1.0] * chunk, [0.0] * chunk, gen,
        )
        firsts.append(out[:, 0])
        accepted += int((counts == 2).sum())
    first = torch.cat(firsts)
    # Accepted iff the first token is the draft: at rate p(draft).
    assert accepted == int((first == draft).sum())
    observed = torch.bincount(first, minlength=p.numel()).double()
    expected = p.double() * N_DRAWS
    # Pool the tokens expected fewer than 5 times into one bin, as the chi-square test requires.
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    exp *= obs.sum() / exp.sum()
    assert big.sum() >= 20, "the distribution is too peaked for a meaningful test"
    result = chisquare(obs.numpy(), exp.numpy())
    assert result.pvalue > 0.01, (which, result)


def test_rejection_rule_detects_a_wrong_distribution(tiny_model) -> None:
    """The test above can fail: the same draws checked against a slightly different target do."""
    logits = _target_logits(tiny_model)
    p = logits[0].softmax(-1)
    draft = int(p.argmax())
    gens = [torch.Generator().manual_seed(i) for i in range(N_DRAWS)]
    out, _ = verify(
        logits.expand(N_DRAWS, 2, -1),
        torch.full((N_DRAWS, 1), draft),
        torch.ones(N_DRAWS, dtype=torch.int64),
        [1.0] * N_DRAWS,
        [-1] * N_DRAWS,
        [1.0] * N_DRAWS,
        [0.0] * N_DRAWS,
        lambda b, j: gens[b],
    )
    observed = torch.bincount(out[:, 0], minlength=p.numel()).double()
    wrong = (logits[0] / 0.9).softmax(-1).double() * N_DRAWS  # the temperature a little off
    big = wrong >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([wrong[big], wrong[~big].sum()[None]])
    exp *= obs.sum() / exp.sum()
    assert chisquare(obs.numpy(), exp.numpy()).pvalue < 0.01

"""The n-gram draft kernel: the torch reference against a plain-Python statement of the rule, and every
implementation resolve_ops picks here (the Triton kernel under the interpreter) against the reference."""
from __future__ import annotations

import random

import pytest
import torch

from tandem.kernels.ops import Ops
from tandem.kernels.reference.ngram_propose import propose_ngram_ref
from tandem.kernels.triton.ngram_propose import BLOCK
from tests.kernels.ops_variants import ops_params


def rule(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The drafting rule, one token at a time: extend with what followed the latest earlier occurrence
    of the longest suffix n-gram (found once, on the known tokens); no match: the last token."""
    length = len(seq)
    for n in range(max_n, min_n - 1, -1):
        starts = [i for i in range(length - n) if seq[i : i + n] == seq[length - n :]]
        if starts:
            src = starts[-1] + n
            ext = list(seq)
            for j in range(k):
                ext.append(ext[src + j])
            return ext[length:]
    return [seq[-1]] * k


def test_reference_follows_the_rule_on_examples() -> None:
    tokens = torch.zeros(4, 32, dtype=torch.int64)
    seqs = [
        [1, 2, 3, 4, 5, 9, 2, 3],  # "2 3" seen before: 4 5 9 2 3 ...
        [7, 7, 7],  # period 1
        [1, 2, 3, 4, 5, 6],  # no repeat: last token
        [5, 6, 1, 2, 8, 1, 2, 3, 9, 4, 1, 2, 3],  # the 3-gram "1 2 3" wins over "1 2" seen first
    ]
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = torch.tensor(s)
    rows = torch.arange(4)
    lens = torch.tensor([len(s) for s in seqs])
    propose_ngram_ref(tokens, rows, lens, 5, 2, 4)
    assert tokens[0, 8:13].tolist() == [4, 5, 9, 2, 3]
    assert tokens[1, 3:8].tolist() == [7, 7, 7, 7, 7]
    assert tokens[2, 6:11].tolist() == [6] * 5
    assert tokens[3, 13:18].tolist() == [9, 4, 1, 2, 3]
    for r, s in enumerate(seqs):
        assert tokens[r, len(s) : len(s) + 5].tolist() == rule(s, 5, 2, 4)


def _random_case(rng: random.Random, width: int, rows: int) -> tuple[torch.Tensor, list[list[int]]]:
    tokens = torch.randint(
        0, 1000, (rows, width), generator=torch.Generator().manual_seed(rng.randrange(1 << 30))
    )
    seqs = []
    for r in range(rows):
        length = rng.choice([1, 2, 3, 5, 17, BLOCK - 1, BLOCK + 3, width - 2, width])
        vocab = rng.choice([2, 3, 8, 50])  # small vocabularies repeat often, large ones rarely
        s = [rng.randrange(vocab) for _ in range(length)]
        if rng.random() < 0.5 and length > 12:  # a copied span, as when an answer quotes its prompt
            a = rng.randrange(length // 2)
            span = s[a : a + rng.randrange(3, 10)]
            s[length - len(span) :] = span
        tokens[r, :length] = torch.tensor(s)
        seqs.append(s)
    return tokens, seqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k,min_n,max_n", [(1, 1, 1), (4, 2, 4), (7, 1, 3)])
def test_reference_follows_the_rule(seed: int, k: int, min_n: int, max_n: int) -> None:
    rng = random.Random(seed)
    width = 2 * BLOCK + 9
    tokens, seqs = _random_case(rng, width, 6)
    rows = torch.arange(6)
    propose_ngram_ref(tokens, rows, torch.tensor([len(s) for s in seqs]), k, min_n, max_n)
    for r, s in enumerate(seqs):
        n_out = min(k, width - len(s))
        assert tokens[r, len(s) : len(s) + n_out].tolist() == rule(s, k, min_n, max_n)[:n_out]


@pytest.mark.parametrize("ops", ops_params())
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k,min_n,max_n", [(1, 1, 1), (4, 2, 4), (5, 1, 3)])
def test_every_implementation_equals_reference(ops: Ops, seed: int, k: int, min_n: int, max_n: int) -> None:
    """The Triton kernel among them; a host proposer (Ops.host_drafts) also returns its matched counts."""
    rng = random.Random(100 + seed)
    width = 2 * BLOCK + 9
    tokens, seqs = _random_case(rng, width, 8)
    rows = torch.tensor(rng.sample(range(8), 5))
    lens = torch.tensor([len(seqs[r]) for r in rows.tolist()])
    want = tokens.clone()
    found = propose_ngram_ref(want, rows, lens, k, min_n, max_n)
    got = ops.propose_ngram(tokens, rows, lens, k, min_n, max_n)
    assert torch.equal(tokens, want)
    assert got == (found if ops.host_drafts else None)

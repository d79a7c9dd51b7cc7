"""Prompts for `tandem bench serve`: random or shared-prefix, as text or token ids, seeded.

Random prompts are drawn token by token from the tokenizer's ordinary (non-special) vocabulary and
decoded to text, so the same prompts can go to any server that uses the same tokenizer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a model directory, or from a GGUF file's metadata."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(path)


def _ordinary_ids(tokenizer: Any) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def make_requests(
    tokenizer: Any,
    dataset: str,
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    token_ids: bool,
    prefix_len: int = 0,
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """`random`: each prompt's length drawn from input_len. `shared-prefix`: num_prefixes system prompts
    of prefix_len tokens, each request one of them plus its own input_len suffix."""
    rng = random.Random(seed)
    vocab = _ordinary_ids(tokenizer)
    prefixes = [[rng.choice(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        ids = [rng.choice(vocab) for _ in range(rng.randint(*input_len))]
        if dataset == "shared-prefix":
            ids = prefixes[i % num_prefixes] + ids
        n_out = rng.randint(*output_len)
        if token_ids:
            out.append(BenchRequest(ids, len(ids), n_out))
        else:
            text = tokenizer.decode(ids)
            # Decoded text re-tokenizes to about, not exactly, the drawn length: report the real one.
            out.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), n_out))
    return out

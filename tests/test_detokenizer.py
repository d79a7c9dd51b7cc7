"""Incremental detokenization, on a tiny byte-level BPE trained here.

The vocab is small (~600) so most CJK chars and emoji are split over several byte tokens, which
is exactly the case incremental decoding has to get right.
"""

from __future__ import annotations

import random
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.detokenizer.incremental import REPLACEMENT, IncrementalDecoder

EOS = "<|endoftext|>"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Inference engines stream tokens to clients as soon as they are decoded.",
    "Please keep the answer short, and stop when you are done with the list.",
    "我们今天去公园散步，天气很好。",
    "中文分词测试，这是一个句子。",
    "机器学习模型正在生成文本。",
    "日本語のテキストです。東京へ行きます。",
    "ありがとうございます、またね。",
    "👨‍👩‍👧 family 🇯🇵 flag 😀 smile 🎉 party",
]
# Chars the tests draw from; some are missing from the corpus entirely (byte tokens only).
ALPHABET = "abc xyz.,!\n中文字日本語の東京好。🎉😀🇯🇵👨‍👩‍👧éß" + "\u200d"


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable char map, which the ByteLevel pre-tokenizer uses for its vocab.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHAR = _bytes_to_unicode()


@cache
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    rng = random.Random(0)
    corpus = [" ".join(rng.sample(SENTENCES, k=4)) for _ in range(300)]
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken("你好", special=False)])  # a plain added token, decoded as text
    return tok


def byte_id(b: int) -> int:
    return tokenizer().token_to_id(BYTE_CHAR[b])


def stream(dec: IncrementalDecoder, ids: list[int], sizes: list[int]) -> list[str]:
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        deltas.append(dec.push(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(dec.flush())
    return deltas


def test_tokenizer_splits_chars() -> None:
    tok = tokenizer()
    assert 500 <= tok.get_vocab_size() <= 610
    for ch in ["😀", "🇯🇵", "é"]:
        assert len(tok.encode(ch).ids) >= 2, ch
    multi = [ch for ch in "中文字日本語の東京好" if len(tok.encode(ch).ids) >= 2]
    assert len(multi) >= 3


MIXED = "Hello 世界! 我们今天去公园散步。日本語のテキスト 👨‍👩‍👧 🇯🇵 😀 done🎉"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 5], [100]])
def test_stream_matches_full_decode(sizes: list[int], skip: bool) -> None:
    tok = tokenizer()
    ids = tok.encode(MIXED + EOS + "尾").ids
    deltas = stream(IncrementalDecoder(tok, skip_special_tokens=skip), ids, sizes)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any(REPLACEMENT in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40), sizes=st.lists(st.integers(1, 6), max_size=8))
def test_stream_matches_full_decode_random_text(text: str, sizes: list[int]) -> None:
    tok = tokenizer()
    ids = tok.encode(text).ids
    deltas = stream(IncrementalDecoder(tok), ids, sizes)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any(REPLACEMENT in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, 599), max_size=30),
    sizes=st.lists(st.integers(1, 4), max_size=6),
    skip=st.booleans(),
)
def test_stream_matches_full_decode_random_ids(ids: list[int], sizes: list[int], skip: bool) -> None:
    # Arbitrary ids, invalid UTF-8 included: the invariant holds for any sequence.
    tok = tokenizer()
    ids = [i % tok.get_vocab_size() for i in ids]
    deltas = stream(IncrementalDecoder(tok, skip_special_tokens=skip), ids, sizes)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(prompt=st.text(alphabet=ALPHABET, max_size=12), text=st.text(alphabet=ALPHABET, max_size=20))
def test_prompt_context(prompt: str, text: str) -> None:
    tok = tokenizer()
    prompt_ids, ids = tok.encode(prompt).ids, tok.encode(text).ids
    dec = IncrementalDecoder(tok, prompt_ids[-4:])
    assert "".join(stream(dec, ids, [1])) == text
    assert dec.output_ids == ids


@pytest.mark.parametrize("ch", ["中", "😀"])
def test_partial_utf8_offsets(ch: str) -> None:
    raw = ch.encode()
    assert len(raw) in (3, 4)
    tok = tokenizer()
    dec = IncrementalDecoder(tok)
    for b in raw[:-1]:  # every strict prefix is an incomplete char: nothing out, offsets stay
        assert dec.push([byte_id(b)]) == ""
        assert (dec.surr_offset, dec.read_offset) == (0, 0)
    assert dec.push([byte_id(raw[-1])]) == ch
    assert (dec.surr_offset, dec.read_offset) == (0, len(raw))
    assert dec.push([tok.token_to_id("a")]) == "a"
    assert (dec.surr_offset, dec.read_offset) == (len(raw), len(raw) + 1)
    # A second char split over two pushes, the first push carrying two byte ids.
    assert dec.push([byte_id(raw[0]), byte_id(raw[1])]) == ""
    assert (dec.surr_offset, dec.read_offset) == (len(raw), len(raw) + 1)
    assert dec.push([byte_id(b) for b in raw[2:]]) == ch
    assert (dec.surr_offset, dec.read_offset) == (len(raw) + 1, 2 * len(raw) + 1)
    assert dec.flush() == ""


def test_flush_emits_genuine_trailing_replacement() -> None:
    tok = tokenizer()
    dec = IncrementalDecoder(tok)
    assert dec.push([tok.token_to_id("a"), byte_id(0xE4), byte_id(0xB8)]) == ""
    assert dec.flush() == "a" + REPLACEMENT == tok.decode(dec.output_ids)


def test_context_ending_mid_char_is_dropped() -> None:
    tok = tokenizer()
    dec = IncrementalDecoder(tok, [tok.token_to_id("a"), byte_id(0xE4)])
    assert dec.ids == [] and dec.read_offset == 0
    assert dec.push([byte_id(0xB8), byte_id(0xAD)]) == ""
    assert dec.flush() == tok.decode([byte_id(0xB8), byte_id(0xAD)])


@pytest.mark.parametrize("emoji", ["😀", "🇯🇵", "🎉", "👩‍👧‍👦"])
def test_multi_token_emoji_never_partial(emoji: str) -> None:
    tok = tokenizer()
    ids = tok.encode(f"x{emoji}y").ids
    assert len(tok.encode(emoji).ids) >= 2
    deltas = stream(IncrementalDecoder(tok), ids, [1])
    assert "".join(deltas) == f"x{emoji}y"
    assert not any(REPLACEMENT in d for d in deltas)
    # Every code point of the emoji arrives whole in one delta (ZWJ/flag parts may be separate).
    for cp in emoji:
        assert any(cp in d for d in deltas)

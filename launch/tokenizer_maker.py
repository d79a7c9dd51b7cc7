"""Train the byte-level BPE tokenizer that ships with every generated model.

Byte-level BPE (GPT-2 style) can encode any UTF-8 string and decode it back exactly, which is what
the engine's detokenizer tests need: merges that straddle the UTF-8 bytes of CJK characters and
multi-codepoint emoji are common in the shipped corpus, so partial-character tokens really occur.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: the trainer assigns special tokens ids 0, 1, 2 before the byte alphabet.
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's thinking switch: with enable_thinking=false the prompt holds an empty think block, so the reply
# is the answer; otherwise the model may open one itself. The markers are plain text to this tokenizer.
QWEN3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "assistant\n{% endif %}",
    "assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}",
)


def _corpus_chunks(text: str, lines_per_chunk: int = 64) -> list[str]:
    # Keep the newlines so "\n" / "\n\n" runs become tokens too, like in real chat/code text.
    lines = text.splitlines(keepends=True)
    return ["".join(lines[i : i + lines_per_chunk]) for i in range(0, len(lines), lines_per_chunk)]


@lru_cache(maxsize=8)
def _trained_json(vocab_size: int, corpus_path: str) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes up front, so text never seen in the corpus still encodes (no <unk>).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = Path(corpus_path).read_text(encoding="utf-8")
    tok.train_from_iterator(_corpus_chunks(text), trainer=trainer)
    return tok.to_str(pretty=True)


def train_tokenizer(vocab_size: int, corpus_path: str | Path = CORPUS_PATH) -> Tokenizer:
    """A fresh Tokenizer (training is cached per process; the BPE trainer is deterministic)."""
    return Tokenizer.from_str(_trained_json(vocab_size, str(corpus_path)))


def write_tokenizer_files(out: Path, vocab_size: int, model_max_length: int,
                          chat_template: str = CHAT_TEMPLATE) -> Tokenizer:
    """Write tokenizer.json + tokenizer_config.json into `out`; returns the tokenizer."""
    tok = train_tokenizer(vocab_size)
    (out / "tokenizer.json").write_text(_trained_json(vocab_size, str(CORPUS_PATH)), encoding="utf-8")
    tok_config = tokenizer_config(model_max_length, chat_template)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    return tok


def tokenizer_config(model_max_length: int, chat_template: str, **more: object) -> dict[str, object]:
    """The tokenizer_config.json of a made model's tokenizer (more: fields beside the usual ones)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": [IM_START, IM_END],
        **more,
        # The default cleanup rewrites " ." to "." and would break exact round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise RuntimeError(f"tokenizer lacks special tokens {missing}")
    return ids  # type: ignore[return-value]

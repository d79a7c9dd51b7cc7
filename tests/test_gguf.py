"""GGUF files in: tiny made models written with gguf's writer (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; random
K-quant blocks, alone or mixed as in llama.cpp's Q4_K_M and Q5_K_M files; llama's Q/K rows permuted as
llama.cpp does) load to gguf's own dequantization, run like their source directory (and, on CPU in float32,
from their quantized blocks), carry their tokenizer, and broken or unsupported files fail with a clear
error. A BF16 file under `--dtype auto` is its bf16 checkpoint: the same weights and tokens as the directory.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.kernels.native.quant_linear import QuantRows, QuantWeight, dequantize
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_config import read_model_config
from tandem.protocol.model_info import read_model_info
from tandem.protocol.tokenizer_loader import load_fast_tokenizer, load_tokenizer
from tandem.worker import loader
from tandem.worker.gguf_weights import iter_gguf_weights
from tandem.worker.layers import PackableLinear
from tandem.worker.loader import load_model
from tests.conftest import ARCHS, check_idle_engine
from tests.gguf_files import K_QUANTS, QTYPES, llamacpp_permute, write_gguf
from tests.kernels.test_cpu_paged_attention import HAS_CC, needs_cc
from tests.kv_pool import Pool


@pytest.fixture(scope="module")
def gguf_file(tiny_model, tmp_path_factory):  # a factory
    root = tmp_path_factory.mktemp("gguf")

    def get(arch: str = "llama", qtype: str = "F32", size: str = "tiny") -> Path:
        out = root / f"{arch}-{size}-{qtype}.gguf"
        if not out.exists():
            write_gguf(tiny_model(arch, size=size), out, qtype)
        return out

    return get


FILE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


# K-quants: random blocks, not the source's
@pytest.mark.parametrize("qtype", sorted(set(QTYPES) - set(K_QUANTS)))
@pytest.mark.parametrize("arch", ARCHS)
def test_weights_equal_gguf_dequantization(arch: str, qtype: str, gguf_file) -> None:
    path = gguf_file(arch, qtype)
    cfg = read_model_config(path)
    # Our HF names, under the GGUF names gguf's own map gives them (the writer used the same map).
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), 2)
    ours = {names.get_name(n, try_suffixes=(".weight", ".bias")): w
            for n, w in iter_gguf_weights(path, cfg, torch.float32, progress=False)}
    reader = gguf.GGUFReader(path)
    assert sorted(ours) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        # a float file's matrices come in its own type (the layers' copy widens or rounds them)
        assert ours[t.name].dtype == (FILE_DTYPES.get(t.tensor_type.name, torch.float32) if len(t.shape) == 2
                                      else torch.float32), t.name
        got = ours[t.name].float().numpy()
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in t.name else cfg.num_key_value_heads
            got = llamacpp_permute(got, heads)  # the file holds llama.cpp's row order
        np.testing.assert_array_equal(got, expected, err_msg=t.name)
        if qtype != "F32" and len(t.shape) == 2:
            assert t.tensor_type == QTYPES[qtype]


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_equal_source_directory(arch: str, tiny_model, gguf_file) -> None:
    seq = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = []
    for source in (tiny_model(arch), gguf_file(arch, "F32")):
        model = load_model(str(source), torch.float32, "cpu")
        pool = Pool(model)
        row = pool.add(len(seq))
        logits.append(model.forward(pool.batch([(row, seq, len(seq))], all_logits=True), pool.kv))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


def _kinds(q: QuantWeight | QuantRows) -> list[str]:
    return [p.qtype for p in q.parts] if isinstance(q, QuantRows) else [q.qtype]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q4_K_M", "Q5_K_M"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_file_runs_from_its_blocks(arch: str, qtype: str, gguf_file, monkeypatch) -> None:
    """On CPU in float32 the quantized layers and the LM head keep the file's blocks (the kernel's weights
    are the dequantized ones exactly), every type of the file among them, and the logits (and so the greedy
    tokens) match the model loaded dequantized. The K-quants' blocks are 256 weights: the "small" model
    (hidden 256, intermediate 768) has whole ones; in the Q4_K_M and Q5_K_M mixes (tests/gguf_files.py)
    fused q/k/v layers hold parts of two or three types."""
    small = qtype in K_QUANTS or qtype.endswith("_M")
    path = str(gguf_file(arch, qtype, size="small" if small else "tiny"))
    quant = load_model(path, torch.float32, "cpu")
    with monkeypatch.context() as m:
        m.setattr(loader, "quantized_types", lambda *a: frozenset())
        plain = load_model(path, torch.float32, "cpu")
    pairs = [(a, b) for a, b in zip(quant.modules(), plain.modules()) if isinstance(a, PackableLinear)]
    assert pairs and all(a.quant is not None and a.weight is None for a, _ in pairs) == HAS_CC
    for a, b in pairs:
        if a.quant is not None:
            assert torch.equal(dequantize(a.quant), b.weight)
    head = quant.model.embed_tokens if quant.lm_head is None else quant.lm_head
    assert (head.head_quant is not None) == HAS_CC
    if quant.lm_head is not None:  # an untied embedding is only looked up: it keeps no blocks
        assert quant.model.embed_tokens.head_quant is None
    if HAS_CC:
        kept = {k for a, _ in pairs for k in _kinds(a.quant)} | set(_kinds(head.head_quant))
        assert kept == {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    seq = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    for model in (quant, plain):
        model.pack_cpu_weights()
        pool = Pool(model)
        row = pool.add(len(seq))
        logits.append(model.forward(pool.batch([(row, seq, len(seq))], all_logits=True), pool.kv))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@needs_cc
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("arch", "qtype", "size"), [("qwen3", "Q8_0", "tiny"), ("llama", "Q4_K", "small"),
                                                     ("qwen2", "Q4_K_M", "small")])
def test_tensor_parallel_ranks_take_their_blocks(arch: str, qtype: str, size: str, rank: int, gguf_file,
                                                  monkeypatch) -> None:
    """Column- and row-parallel layers and the vocab-parallel head cut the blocks as they cut a float
    weight; a row-parallel cut off the type's block edges (Q4_K's 256 at 128 inputs a rank) is
    dequantized instead, and that layer runs in float32."""
    path = str(gguf_file(arch, qtype, size=size))
    quant = load_model(path, torch.float32, "cpu", tp_rank=rank, tp_size=2)
    monkeypatch.setattr(loader, "quantized_types", lambda *a: frozenset())
    plain = load_model(path, torch.float32, "cpu", tp_rank=rank, tp_size=2)
    kept = []
    for a, b in zip(quant.modules(), plain.modules()):
        if isinstance(a, PackableLinear):
            assert torch.equal(dequantize(a.quant) if a.quant is not None else a.weight, b.weight)
            kept.append(a.quant is not None)
    edges = qtype == "Q8_0"  # o_proj and down_proj take 128 and 384 inputs per rank: not K-quant edges
    assert kept == [True, edges, True, edges] * quant.config.num_hidden_layers
    head = quant.model.embed_tokens if quant.lm_head is None else quant.lm_head
    plain_head = plain.model.embed_tokens if plain.lm_head is None else plain.lm_head
    rows = head.end - head.start
    assert torch.equal(dequantize(head.head_quant), plain_head.weight[:rows])


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_file_runs_as_its_bf16_checkpoint(tiny_model, gguf_file, monkeypatch, fast_bf16: bool) -> None:
    """`auto` keeps a BF16 file's weights bf16 on any CPU: half the bytes of widening them. Where the CPU
    multiplies bf16 natively the directory's are bf16 too and the tokens are the directory's exactly (gguf
    rounds float32 to bf16 to nearest even, as torch does); elsewhere (here: this CPU taken for an AVX2 one)
    the directory's stay float32 and the file's are widened exactly where they are multiplied (the C
    kernel's rows, torch's per call for the 30-token prompt): the same tokens again."""
    from tandem.kernels import cpu_linear
    from tandem.kernels.native.cpu_caps import parse_cpuinfo
    from tandem.protocol.engine_config import EngineConfig
    from tandem.worker import device
    from tandem.worker.device import resolve_weight_dtype
    from tandem.worker.model_runner import ModelRunner
    from tests.step_loop import generate

    if not fast_bf16:
        caps = parse_cpuinfo("model name\t: X\nflags\t\t: avx2 fma f16c\n", 2)
        monkeypatch.setattr(device, "cpu_caps", lambda: caps)
        monkeypatch.setattr(cpu_linear, "cpu_caps", lambda: caps)
    src = tiny_model("llama")
    dir_dtype = resolve_weight_dtype("auto", torch.device("cpu"))  # a float directory's, on this CPU
    assert (dir_dtype == torch.bfloat16) == (fast_bf16 and device.cpu_caps().fast_bf16)
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (1, 7, 30)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    outs = []
    for model, want in ((gguf_file("llama", "BF16"), torch.bfloat16), (src, dir_dtype)):
        cfg = EngineConfig(model=str(model), device="cpu", dtype="auto", kv_cache_tokens=512)
        info = read_model_info(model)
        runner = ModelRunner(cfg, info)
        assert runner.weight_dtype == want, (model, runner.weight_dtype)
        layer = runner.model.model.layers[0].self_attn.o_proj
        assert layer.weight.dtype == want, layer.weight.dtype
        outs.append(generate(cfg, info, runner, prompts, params))
    assert outs[0] == outs[1]


def test_f16_file_keeps_its_halves_and_gives_the_float32_files_logits(tiny_model, gguf_file) -> None:
    """`auto` keeps an F16 file's linear weights float16 on CPU (half the bytes a step reads), widened exactly
    where they are multiplied: the same logits, bit for bit, as the F32 file holding those values (a decode
    batch in the C kernel, a prefill of more rows than it takes through torch)."""
    import msgspec

    from tandem.protocol.engine_config import EngineConfig
    from tandem.worker.model_runner import ModelRunner
    from tests.step_loop import generate

    # An F32 file of the F16 file's values: the source's weights rounded to halves first.
    src = tiny_model("llama")
    halves = Path(str(gguf_file("llama", "F16")))
    reader = gguf.GGUFReader(halves)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {gguf.GGMLQuantizationType.F16}
    rounded = src.parent / "llama-f16-values"
    if not rounded.exists():
        import shutil

        from safetensors.torch import load_file, save_file

        shutil.copytree(src, rounded)
        tensors = load_file(rounded / "model.safetensors")
        save_file({k: v.half().float() if v.dim() == 2 else v for k, v in tensors.items()},
                  rounded / "model.safetensors")
    floats = src.parent / "llama-f16-values.gguf"
    if not floats.exists():
        write_gguf(rounded, floats, "F32")
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (1, 7, 200)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=5)]
    outs = []
    for model, want in ((halves, torch.float16), (floats, torch.float32)):
        cfg = EngineConfig(model=str(model), device="cpu", dtype="auto", kv_cache_tokens=1024)
        info = read_model_info(model)
        runner = ModelRunner(cfg, info)
        assert runner.weight_dtype == want, (model, runner.weight_dtype)
        assert runner.model.model.layers[0].mlp.down_proj.weight.dtype == want
        deltas: list = []
        generate(cfg, info, runner, prompts, params, deltas)
        outs.append(sorted(msgspec.to_builtins([(d.rid, d.token_ids, d.logprobs, d.prompt_logprobs)
                                                for d in deltas]), key=lambda d: d[0]))
    assert outs[0] == outs[1]


def test_config_and_tokenizer_from_metadata(tiny_model, gguf_file) -> None:
    src, path = tiny_model("qwen3"), gguf_file("qwen3", "Q8_0")
    assert read_model_info(path) == read_model_info(src)
    a, b = read_model_config(src), read_model_config(path)
    for f in ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "tie_word_embeddings"):
        assert getattr(a, f) == getattr(b, f), f
    assert b.rms_norm_eps == pytest.approx(a.rms_norm_eps)
    ta, tb = load_tokenizer(src), load_tokenizer(path)
    text = "Hello world, 你好 😀 12345\n\n  def f(x):\n\treturn x<|im_end|>"
    assert tb(text).input_ids == ta(text).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert tb.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == ta.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    ids = ta(text).input_ids
    assert load_fast_tokenizer(path).decode(ids, skip_special_tokens=False) == text


def test_engine_serves_gguf_like_its_directory(tiny_model, gguf_file, launch_client) -> None:
    """The whole engine on a .gguf: tokenizer, detokenizer, stop checks and grammar from its metadata."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=["the"])
    prompts = ["Hello world", "你好 😀", "def f(x):"]
    outs = {}
    for source in (tiny_model("llama"), gguf_file("llama", "F32")):
        client = launch_client(source)
        outs[source.suffix] = [(c.text, c.token_ids, c.finish_reason) for c in
                               client.generate_batch(prompts, params, progress=False)]
        json_out = client.generate(
            "Answer:", SamplingParams(max_tokens=24, temperature=0.0, json_object=True)
        )
        outs[source.suffix].append(json_out.text)
        check_idle_engine(client)
        client.close()
    assert outs[".gguf"] == outs[""]


def _corrupt(path: Path, out: Path, how: str) -> Path:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:
        data[:4] = b"GGML"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("how", ["truncated", "magic"])
def test_broken_file_is_a_clear_error(how: str, gguf_file, tmp_path) -> None:
    bad = _corrupt(gguf_file("llama", "Q8_0"), tmp_path / f"{how}.gguf", how)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        read_model_info(bad)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(bad), torch.float32, "cpu")


def test_unsupported_architecture_and_tensor_type(tiny_model, tmp_path) -> None:
    src = tiny_model("llama")
    mamba = write_gguf(src, tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        read_model_info(mamba)
    ints = write_gguf(
        src, tmp_path / "i8.gguf", override={"blk.1.ffn_up.weight": np.ones((128, 64), np.int8)}
    )
    with pytest.raises(ModelLoadError, match="tensor 'blk.1.ffn_up.weight' has type I8"):
        load_model(str(ints), torch.float32, "cpu")


@pytest.mark.parametrize("which", ["truncated", "i8"])
def test_serve_reports_a_bad_gguf_in_one_line(which: str, tiny_model, gguf_file, tmp_path) -> None:
    """From the worker too (the tensor type is found while loading): the message, no traceback."""
    if which == "truncated":
        bad = _corrupt(gguf_file("llama", "F32"), tmp_path / "t.gguf", "truncated")
        expect = "not a readable GGUF file"
    else:
        bad = write_gguf(tiny_model("llama"), tmp_path / "i8.gguf",
                         override={"blk.0.attn_v.weight": np.ones((32, 64), np.int8)})
        expect = "has type I8, which cannot be dequantized"
    r = subprocess.run([sys.executable, "-m", "tandem.launch.cli", "serve", "--model", str(bad)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 1
    assert expect in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_pull_unknown_name_lists_the_known_ones(capsys) -> None:
    from tandem.launch.cli import main

    with pytest.raises(SystemExit) as e:
        main(["pull", "gpt-5"])
    assert e.value.code == 2
    assert "unknown model 'gpt-5'; known: gemma3-270m, smollm2-135m-instruct" in capsys.readouterr().err

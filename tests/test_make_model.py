"""The model maker: directories transformers loads offline, seeded weights, tokenizer and decisiveness."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tandem.launch import tokenizer_maker
from tandem.launch.make_model import SIZES, build_config, main, make_model

ARCHS = ("llama", "qwen2", "qwen3")
TIED = {"llama": False, "qwen2": False, "qwen3": True}
MIXED_TEXT = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "今天天气真好，我们去公园散步吧。服务器半夜报警了！",
    "こんにちは、世界。안녕하세요 세계.",
    "Family: 👨‍👩‍👧 flags: 🇯🇵🇨🇳🇺🇸 thumbs 👍🏽 rainbow 🏳️‍🌈 keycap 1️⃣",
    "def f(x):\n    return x ** 2  # 平方\n\n\tdone  \r\n",
    "  leading and trailing spaces , odd punctuation . ?!  ",
    "mixed中文English混合😀text, 数字 3.14159 and ¥100",
    "\u0000\u00ff\U0010ffff rare code points ǅ ﬁ",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("made")
    return {arch: make_model(arch, "tiny", root / arch, seed=0) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_runs(models: dict[str, Path], arch: str) -> None:
    path = models[arch]
    assert {p.name for p in path.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode("The night train leaves at 十点 🚆")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_config_fields(models: dict[str, Path], arch: str) -> None:
    path = models[arch]
    raw = json.loads((path / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    tiny = SIZES["tiny"]
    assert raw["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ]
    assert raw["tie_word_embeddings"] is TIED[arch]
    assert cfg.vocab_size >= len(tok) and cfg.vocab_size == tiny.vocab
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, 2, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert raw.get("head_dim", cfg.hidden_size // cfg.num_attention_heads) == tiny.head_dim
    assert raw["rms_norm_eps"] == 1e-6 and raw["max_position_embeddings"] == 2048
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert raw["torch_dtype"] == raw["dtype"] == "float32"
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert raw["eos_token_id"] == raw["pad_token_id"] == tok.eos_token_id == tok.pad_token_id == eos
    gen = json.loads((path / "generation_config.json").read_text())
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert gen == {"eos_token_id": [eos, im_end], "pad_token_id": eos, "do_sample": False}

    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    assert ("lm_head.weight" in keys) is not TIED[arch]
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in keys) is (arch == "qwen3")
    if arch == "qwen2":
        assert raw["attention_bias"] is True


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    a = make_model("qwen2", "tiny", tmp_path / "a", seed=7)
    b = make_model("qwen2", "tiny", tmp_path / "b", seed=7)
    c = make_model("qwen2", "tiny", tmp_path / "c", seed=8)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(c / "model.safetensors", "pt") as fc:
        key = "model.layers.0.mlp.up_proj.weight"
        assert not torch.equal(fa.get_tensor(key), fc.get_tensor(key))


def test_tokenizer_training_is_deterministic() -> None:
    fresh = tokenizer_maker._trained_json.__wrapped__(1024, str(tokenizer_maker.CORPUS_PATH))
    assert fresh == tokenizer_maker._trained_json(1024, str(tokenizer_maker.CORPUS_PATH))


@pytest.mark.parametrize("text", MIXED_TEXT)
def test_tokenizer_round_trips_exactly(models: dict[str, Path], text: str) -> None:
    tok = AutoTokenizer.from_pretrained(models["llama"])
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_tokenizer_has_partial_character_tokens(models: dict[str, Path]) -> None:
    # The detokenizer must cope with tokens that end mid-character; make sure such tokens exist.
    tok = AutoTokenizer.from_pretrained(models["llama"])
    for text in ("今天天气真好，我们去公园散步吧。", "👨‍👩‍👧 🇯🇵🇨🇳"):
        ids = tok.encode(text)
        assert len(ids) < len(text.encode()), "expected merges inside the UTF-8 bytes"
        assert any("\ufffd" in tok.decode([i]) for i in ids), "expected a token that splits a character"


@functools.cache
def _raw_tokenizer():  # a tokenizers.Tokenizer
    return tokenizer_maker.train_tokenizer(1024)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_tokenizer_round_trips_any_text(text: str) -> None:
    tok = _raw_tokenizer()
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_and_chat_template(models: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models["qwen3"])
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert len(set(specials)) == 3 and all(i < len(tok) for i in specials)
    assert tok.encode("<|im_start|>user")[0] == specials[1]
    assert tok.bos_token_id is None  # add_bos_token is off: prompts start with the text itself
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 👋"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    # Qwen3's thinking switch: off, the prompt holds an empty think block (the reply is the answer).
    off = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert off == text + "<think>\n\n</think>\n\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == specials[1] and ids.count(specials[2]) == 2
    assert tok.decode(ids) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_random_model_is_decisive(models: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(models[arch]).eval()
    tok = AutoTokenizer.from_pretrained(models[arch])
    corpus = tokenizer_maker.CORPUS_PATH.read_text(encoding="utf-8")
    ids = torch.tensor([tok.encode(corpus[i * 9000 : i * 9000 + 1500])[:128] for i in range(4)])
    with torch.no_grad():
        logits = model(ids).logits
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median() > 0.2, gaps.median()
    assert (gaps < 1e-3).float().mean() < 0.02
    # Greedy decoding does not lock onto one token right away.
    prompt = torch.tensor([tok.encode("The night train leaves at")])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert len(set(out)) >= 4, out
    assert len(set(out[:4])) > 1, out


def test_num_kv_heads_override(tmp_path: Path) -> None:
    path = make_model("llama", "tiny", tmp_path / "mqa", num_kv_heads=1)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.num_key_value_heads == 1
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [16, 64]
    AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError):
        make_model("llama", "tiny", tmp_path / "bad", num_kv_heads=3)


@pytest.mark.parametrize("arch", ARCHS)
def test_bench_size_parameter_count(arch: str) -> None:
    config = build_config(arch, "bench", SIZES["bench"].vocab, eos_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    assert 25e6 <= n_params <= 35e6, n_params
    assert config.max_position_embeddings == 4096


def test_cli_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--arch", "qwen3", "--size", "tiny", "--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert "qwen3" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("made-moe")
    return {arch: make_model(arch, "tiny", root / arch, seed=0) for arch in MOE_ARCHS}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_model_loads_in_transformers_with_every_weight(moe_models: dict[str, Path], arch: str) -> None:
    """Written in a published checkpoint's layout (experts one by one), which transformers converts: nothing
    missing, nothing left over; the router and experts as configured."""
    model, info = AutoModelForCausalLM.from_pretrained(moe_models[arch], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg = model.config
    experts = cfg.num_local_experts if arch == "mixtral" else cfg.num_experts
    assert (experts, cfg.num_experts_per_tok) == (8, 2)
    with safe_open(moe_models[arch] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    expert = "block_sparse_moe.experts.7.w2" if arch == "mixtral" else "mlp.experts.7.down_proj"
    assert f"model.layers.1.{expert}.weight" in keys
    assert ("model.layers.0.mlp.shared_expert_gate.weight" in keys) is (arch == "qwen2_moe")
    assert (arch == "mixtral" or cfg.norm_topk_prob) is (arch != "qwen2_moe")
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_model_is_decisive_in_its_routing_and_logits(moe_models: dict[str, Path], arch: str) -> None:
    """The router's k-th and (k+1)-th logits stand well apart (an engine that rounds differently picks the
    same
    experts), and the output logits are as decisive as the dense models'."""
    model = AutoModelForCausalLM.from_pretrained(moe_models[arch]).eval()
    tok = AutoTokenizer.from_pretrained(moe_models[arch])
    corpus = tokenizer_maker.CORPUS_PATH.read_text(encoding="utf-8")
    ids = torch.tensor([tok.encode(corpus[i * 9000 : i * 9000 + 1500])[:128] for i in range(4)])
    gaps = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, inp, out: gaps.append((lambda t: t[:, 1] - t[:, 2])(out[0].topk(3, -1).values)))
        for layer in model.model.layers]
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    router_gaps = torch.cat(gaps)
    assert router_gaps.median() > 0.2 and (router_gaps < 1e-4).float().mean() < 1e-3, router_gaps.median()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).flatten().median() > 0.2


def test_moe_overrides_and_bench_size(tmp_path: Path) -> None:
    path = make_model(
        "qwen3_moe", "tiny", tmp_path / "k8", num_experts=4, experts_per_tok=4, tie_embeddings=True
    )
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.tie_word_embeddings) == (4, 4, True)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    with pytest.raises(ValueError, match="experts_per_tok=5"):
        make_model("mixtral", "tiny", tmp_path / "bad", num_experts=4, experts_per_tok=5)
    # --size bench: 8 experts, top 2, a token's two experts as wide as the dense bench model's MLP
    bench = build_config("qwen3_moe", "bench", SIZES["bench"].vocab, eos_id=0)
    assert (bench.num_experts, bench.num_experts_per_tok) == (8, 2)
    assert bench.num_experts_per_tok * bench.moe_intermediate_size == SIZES["bench"].intermediate
    assert (
        main(
            [
                "--arch",
                "mixtral",
                "--size",
                "tiny",
                "--out",
                str(tmp_path / "cli"),
                "--experts-per-tok",
                "1",
                "--tie-embeddings",
                "true",
            ]
        )
        == 0
    )
    assert AutoConfig.from_pretrained(tmp_path / "cli").num_experts_per_tok == 1


def test_gemma3_model_loads_in_transformers_with_its_layout(tmp_path: Path) -> None:
    """Gemma 3: every weight the checkpoint holds is one transformers' Gemma3ForCausalLM uses, the window is
    crossed by short prompts (16 keys, a global layer every third), one KV head, a head wider than hidden /
    heads, linear-scaled global RoPE and soft-capped logits; its logits are decisive."""
    path = make_model("gemma3", "tiny", tmp_path / "g", seed=0)
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForCausalLM"] and raw["model_type"] == "gemma3_text"
    assert raw["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (raw["sliding_window"], raw["num_key_value_heads"], raw["head_dim"]) == (16, 1, 32)
    assert raw["rope_parameters"]["full_attention"]["rope_type"] == "linear"
    assert raw["final_logit_softcapping"] == 10.0 and raw["hidden_activation"] == "gelu_pytorch_tanh"
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with safe_open(path / "model.safetensors", "pt") as f:
        norms = [f.get_tensor(k) for k in f.keys() if k.endswith("norm.weight") and k != "model.norm.weight"]
    assert abs(float(torch.cat(norms).mean())) < 0.05  # Gemma scales by 1 + w: w is drawn around 0
    tok = AutoTokenizer.from_pretrained(path)
    corpus = tokenizer_maker.CORPUS_PATH.read_text(encoding="utf-8")
    ids = torch.tensor([tok.encode(corpus[i * 9000 : i * 9000 + 1500])[:128] for i in range(4)])
    with torch.no_grad():
        top2 = model.eval()(ids).logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median() > 0.2 and (gaps < 1e-3).float().mean() < 0.02, gaps.median()
    config = build_config("gemma3", "bench", SIZES["bench"].vocab, eos_id=0)
    assert config.layer_types.count("full_attention") == 2 and config.sliding_window == 128

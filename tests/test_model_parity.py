"""Our Llama/Qwen2/Qwen3/Gemma 3 against transformers on tiny random models: mixed paged batches and greedy
decode (Gemma 3's sliding layers well past their window, in the shared KV pool and in one of their own)."""

from __future__ import annotations

import json
import os

import pytest
import torch

# The triton backend runs on CPU tensors here; with a GPU, natively in tests/kernels/test_gpu.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

from tandem.kernels.ops import ATTENTION_BACKENDS, resolve_ops
from tandem.worker.loader import load_model
from tests.kernels.ops_variants import cpu_triton
from tests.kv_pool import Pool

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so the scaling matters at our positions
}
VARIANTS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "llama-tied-bias-llama3rope": lambda: LlamaConfig(
        **COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE
    ),
    "qwen2-tied-mqa": lambda: Qwen2Config(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True),
    "qwen3-headdim32": lambda: Qwen3Config(**COMMON, head_dim=32),
    "qwen3-tied-mha": lambda: Qwen3Config(
        **{**COMMON, "num_key_value_heads": 4}, head_dim=16, tie_word_embeddings=True
    ),
    # An attention scale apart from head_dim's, a window of 6, every other layer global, local and global
    # RoPE bases, scaled global RoPE, soft-capped logits; untied, one KV head.
    "gemma3-scalar-softcap": lambda: Gemma3TextConfig(
        **{**COMMON, "num_key_value_heads": 1, "num_hidden_layers": 4},
        head_dim=24,
        query_pre_attn_scalar=40,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=5.0,
        tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are decisive (greedy paths must not hinge on near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                std = (
                    1.0 if "embed_tokens" in name else (4.0 if "lm_head" in name else 1.0) / p.shape[1] ** 0.5
                )
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("norm.weight"):  # ~1 as a scale (Gemma's scales by 1 + w)
                off = 0.0 if model.config.model_type == "gemma3_text" else 1.0
                p.copy_(off + 0.2 * torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_and_dir(request, tmp_path_factory):
    cfg = VARIANTS[request.param]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    _randomize(model, seed=sum(map(ord, request.param)))
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("backend", [pytest.param(b, marks=cpu_triton) if b == "triton" else b
                                     for b in ATTENTION_BACKENDS if b != "auto"])
def test_mixed_batch_matches_hf(hf_and_dir, backend):
    """With sliding-window layers: in the shared pool and in one of their own."""
    hf, path = hf_and_dir
    model = load_model(
        path, torch.float32, torch.device("cpu"), ops=resolve_ops("cpu", torch.float32, backend)
    )
    g = torch.Generator().manual_seed(1)
    seqs = {n: torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 7, 12, 17, 23, 40)}
    ref = {n: _hf_logits(hf, s) for n, s in seqs.items()}
    for swa in (False, True) if model.config.has_sliding_layers else (False,):
        pool = Pool(model, swa=swa)
        rows = {n: pool.add(n) for n in seqs}
        # Step 1: the decode requests' contexts and the first chunk (10 tokens) of the 23-token prompt.
        # Step 2 mixes decodes (lengths 5/17/40, so several length groups), fresh prefills (12, 7) and chunk
        # 2.
        # Entries: (sequence, first new position, seq_len after the step).
        step1 = [(5, 0, 4), (17, 0, 16), (40, 0, 39), (23, 0, 10)]
        step2 = [(5, 4, 5), (12, 0, 12), (23, 10, 23), (17, 16, 17), (7, 0, 7), (40, 39, 40)]
        for step in (step1, step2):
            batch = pool.batch([(rows[n], seqs[n][a:b], b) for n, a, b in step], all_logits=True)
            logits = model.forward(batch, pool.kv)
            assert logits.dtype == torch.float32 and logits.shape == (batch.num_tokens, VOCAB)
            expected = torch.cat([ref[n][a:b] for n, a, b in step])
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_greedy_decode_matches_generate(hf_and_dir):
    hf, path = hf_and_dir
    model = load_model(path, torch.float32, "cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14)]
    new = 20
    pool = Pool(model, seed=3)
    rows = [pool.add(len(p) + new) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    step = [(r, p, len(p)) for r, p in zip(rows, prompts, strict=True)]
    for _ in range(new):
        tokens = model.forward(pool.batch(step), pool.kv).argmax(-1).tolist()
        for o, t in zip(outs, tokens, strict=True):
            o.append(t)
        step = [(r, [t], s + 1) for (r, _, s), t in zip(step, tokens, strict=True)]
    for p, o in zip(prompts, outs, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p) :].tolist()
        assert o == ref


def test_bf16_close_to_fp32(hf_and_dir):
    _, path = hf_and_dir
    seq = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype, "cpu")
        pool = Pool(model)
        row = pool.add(len(seq))
        out[dtype] = model.forward(pool.batch([(row, seq, len(seq))], all_logits=True), pool.kv)
    assert out[torch.bfloat16].dtype == torch.float32
    err = (out[torch.bfloat16] - out[torch.float32]).abs().max()
    assert err < 0.05 * out[torch.float32].abs().max()


def test_unknown_architecture_and_missing_weights(hf_and_dir, tmp_path):
    _, path = hf_and_dir
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        load_model(str(bad), torch.float32, "cpu")
    # Declaring more layers than the checkpoint holds must fail loudly, not run with garbage weights.
    more = {**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}
    if cfg.get("layer_types"):
        more["layer_types"] = cfg["layer_types"] + ["full_attention"]
    (bad / "config.json").write_text(json.dumps(more))
    os.symlink(os.path.join(path, "model.safetensors"), bad / "model.safetensors")
    with pytest.raises(ValueError, match="missing"):
        load_model(str(bad), torch.float32, "cpu")

"""The MoE models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against transformers on seeded random
models: mixed paged batches through every implementation of the experts resolve_ops picks here (the C
layer, the torch reference, the Triton grouped product interpreted), top-k 1, 2 and 8, tied and untied,
a dense layer among MoE ones; the checkpoint layouts they load from, and what they refuse."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.moe import experts_ref
from tandem.kernels.triton.moe import experts_triton
from tandem.launch.make_model import init_weights, make_model
from tandem.worker.layers.moe import FusedMoE
from tandem.worker.loader import load_model
from tandem.worker.models.llama import LlamaMLP
from tests.kernels.ops_variants import cpu_triton, switches
from tests.kv_pool import Pool
from tests.test_model_parity import COMMON, _randomize

# name -> make_model's arguments
MADE = {
    "qwen3_moe-k1": ("qwen3_moe", {"experts_per_tok": 1}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-k8-tied": ("qwen3_moe", {"experts_per_tok": 8, "tie_embeddings": True}),
    "qwen2_moe-shared": ("qwen2_moe", {}),
    "mixtral-kv1": ("mixtral", {"num_kv_heads": 1}),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    dirs = {name: make_model(arch, "tiny", root / name, seed=3, **kw) for name, (arch, kw) in MADE.items()}
    # A Qwen3-MoE whose second layer is a dense MLP (mlp_only_layers), made by transformers itself.
    cfg = Qwen3MoeConfig(
        **COMMON,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    hf = AutoModelForCausalLM.from_config(cfg)
    _randomize(hf, seed=5)
    dirs["qwen3_moe-dense-layer"] = root / "dense-layer"
    hf.save_pretrained(dirs["qwen3_moe-dense-layer"])
    return dirs


_hf: dict[str, torch.nn.Module] = {}


def _hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    if str(path) not in _hf:
        _hf[str(path)] = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return _hf[str(path)](torch.tensor([tokens])).logits[0].float()


def _run(model, seqs: dict[int, list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step of decode contexts and a first prefill chunk, then decodes, fresh prefills and the chunk's rest:
    each step's logits beside the positions' (sequence, start, end)."""
    pool = Pool(model)
    rows = {n: pool.add(n) for n in seqs}
    steps = [[(5, 0, 4), (17, 0, 16), (40, 0, 39), (23, 0, 10)],
             [(5, 4, 5), (12, 0, 12), (23, 10, 23), (17, 16, 17), (40, 39, 40)]]
    out = []
    for step in steps:
        batch = pool.batch([(rows[n], seqs[n][a:b], b) for n, a, b in step], all_logits=True)
        out.append((model.forward(batch, pool.kv), step))
    return out


# The experts' three implementations: the C layer (where the C kernels build), the torch reference, the Triton
# grouped product (interpreted on CPU; natively in tests/kernels/test_gpu.py).
EXPERTS = {"c": {}, "torch": {"TANDEM_NO_NATIVE": "1", "TANDEM_TRITON": "0"},
           "triton": {"TANDEM_NO_NATIVE": "1", "TANDEM_TRITON": "1"}}


@pytest.mark.parametrize(
    "experts", [pytest.param(k, marks=cpu_triton) if k == "triton" else k for k in EXPERTS]
)
@pytest.mark.parametrize("name", [*MADE, "qwen3_moe-dense-layer"])
def test_mixed_batches_match_transformers(name: str, experts: str, moe_dirs) -> None:
    path = moe_dirs[name]
    with switches(EXPERTS[experts]):
        ops = resolve_ops("cpu", torch.float32, "cpu")
    model = load_model(str(path), torch.float32, "cpu", ops=ops)
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, FusedMoE)]
    assert moe and all(m.native == ops.native for m in moe)
    assert (
        ops.native
        or ops.moe_experts is {"torch": experts_ref, "triton": experts_triton, "c": experts_ref}[experts]
    )
    assert isinstance(model.model.layers[1].mlp, LlamaMLP) is name.endswith("dense-layer")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    seqs = {n: torch.randint(3, min(vocab, 1000), (n,), generator=g).tolist() for n in (5, 12, 17, 23, 40)}
    ref = {n: _hf_logits(path, s) for n, s in seqs.items()}
    for logits, step in _run(model, seqs):
        expected = torch.cat([ref[n][a:b] for n, a, b in step])
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)


def test_transformers_in_memory_layout_loads_alike(moe_dirs, tmp_path) -> None:
    """transformers 5's fused [E, 2I, H] / [E, H, I] expert tensors (its in-memory names) load to the same
    model as the per-expert checkpoint."""
    src = moe_dirs["qwen3_moe"]
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    from transformers import AutoConfig

    save_file(init_weights(AutoConfig.from_pretrained(src), seed=3), str(fused / "model.safetensors"))
    seq = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    for path in (src, fused):
        model = load_model(str(path), torch.float32, "cpu")
        pool = Pool(model)
        row = pool.add(len(seq))
        logits.append(model.forward(pool.batch([(row, seq, len(seq))], all_logits=True), pool.kv))
    assert torch.equal(logits[0], logits[1])


def test_missing_or_stray_expert_weights_are_errors(moe_dirs, tmp_path) -> None:
    src = moe_dirs["mixtral-kv1"]
    weights = load_file(str(src / "model.safetensors"))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.block_sparse_moe.experts.3.w3.weight"}
    save_file(missing, str(bad / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing 1 expert weights, e.g. \['model.layers.1.mlp.experts.3.up_proj'"
    ):
        load_model(str(bad), torch.float32, "cpu")
    cfg = json.loads((src / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 4}))
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="expert 4 of a layer with 4 experts"):
        load_model(str(bad), torch.float32, "cpu")
    (bad / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and num_experts=8"):
        load_model(str(bad), torch.float32, "cpu")


def test_bf16_close_to_fp32(moe_dirs) -> None:
    """bf16 on CPU (what --dtype auto picks on AMX CPUs) runs the torch experts: close to float32."""
    seq = torch.randint(3, 1000, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(str(moe_dirs["qwen2_moe-shared"]), dtype, "cpu")
        pool = Pool(model)
        row = pool.add(len(seq))
        out[dtype] = model.forward(pool.batch([(row, seq, len(seq))], all_logits=True), pool.kv)
    err = (out[torch.bfloat16] - out[torch.float32]).abs().max()
    assert err < 0.05 * out[torch.float32].abs().max()


def test_the_c_layer_is_used_where_the_c_kernels_run(moe_dirs) -> None:
    with switches({}):
        native = resolve_ops("cpu", torch.float32).native
    model = load_model(str(moe_dirs["qwen3_moe"]), torch.float32, "cpu")
    layer = model.model.layers[0].mlp
    assert layer.native is native
    # natively the float32 experts live only in the kernel's panels
    assert (layer.experts.w13 is None and layer.experts.packed13 is not None) is native

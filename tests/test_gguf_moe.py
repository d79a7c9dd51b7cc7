"""GGUF files of MoE models, written from made models with gguf's writer as llama.cpp lays them out (3-D
ffn_*_exps expert tensors, the router in F32, Mixtral as a "llama" file with permuted Q/K): the experts load
to
gguf's dequantization, stay in their blocks on CPU in float32 and run like the dequantized model, the engine
on the .gguf gives transformers' tokens on its converted directory, and an expert count that does not match
the tensors is a one-line error."""
from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.kernels.native.moe import F32_KIND
from tandem.kernels.native.quant_pack import GGUF_BLOCKS
from tandem.launch.convert import convert
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_config import read_model_config
from tandem.protocol.model_info import read_model_info
from tandem.worker import loader
from tandem.worker.gguf_weights import iter_gguf_weights
from tandem.worker.layers.moe import FusedMoE
from tandem.worker.loader import load_model
from tests.c_kernels import needs_c_kernels
from tests.conftest import check_idle_engine
from tests.gguf_files import write_gguf
from tests.kernels.test_cpu_paged_attention import HAS_CC
from tests.kv_pool import Pool
from tests.reference import assert_parity_floor, greedy


@pytest.fixture(scope="module")
def moe_gguf(tiny_model, tmp_path_factory):  # a factory
    root = tmp_path_factory.mktemp("gguf-moe")

    def get(arch: str, qtype: str, size: str = "tiny") -> Path:
        out = root / f"{arch}-{size}-{qtype}.gguf"
        if not out.exists():
            write_gguf(tiny_model(arch, size=size), out, qtype)
        return out

    return get


@pytest.mark.parametrize(
    ("arch", "qtype"), [("qwen3_moe", "Q8_0"), ("mixtral", "Q4_0"), ("qwen2_moe", "F16")]
)
def test_expert_weights_equal_gguf_dequantization(arch: str, qtype: str, moe_gguf) -> None:
    path = moe_gguf(arch, qtype)
    ours = dict(iter_gguf_weights(path, read_model_config(path), torch.float32, progress=False))
    reader = gguf.GGUFReader(path)
    exps = [t for t in reader.tensors if t.name.endswith("_exps.weight")]
    assert len(exps) == 3 * 2 and all(t.tensor_type.name == qtype for t in exps)
    for t in exps:
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        layer, which = t.name.split(".")[1], t.name.split(".")[2].split("_")[1]
        for e in range(want.shape[0]):
            got = ours[f"model.layers.{layer}.mlp.experts.{e}.{which}_proj.weight"]
            np.testing.assert_array_equal(got.numpy(), want[e], err_msg=f"{t.name} expert {e}")
    router = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert router.tensor_type.name == "F32"  # as llama.cpp keeps it


@pytest.mark.parametrize(
    ("arch", "qtype", "size"),
    [
        ("qwen3_moe", "Q8_0", "tiny"),
        ("qwen2_moe", "Q4_0", "tiny"),
        ("mixtral", "Q5_1", "tiny"),
        ("qwen3_moe", "Q4_K", "small"),
        ("mixtral", "Q4_K_M", "small"),
    ],
)
def test_quantized_experts_run_from_their_blocks(
    arch: str, qtype: str, size: str, moe_gguf, monkeypatch
) -> None:
    """On CPU in float32 every expert keeps the file's blocks (the kernel's weights are gguf's dequantized
    ones exactly) and the logits match the model loaded dequantized."""
    path = str(moe_gguf(arch, qtype, size))
    quant = load_model(path, torch.float32, "cpu")
    with monkeypatch.context() as m:
        m.setattr(loader, "quantized_types", lambda *a: frozenset())
        plain = load_model(path, torch.float32, "cpu")
    kinds = {t.name.split(".")[2]: t.tensor_type.name for t in gguf.GGUFReader(path).tensors
             if t.name.startswith("blk.0.") and t.name.endswith("_exps.weight")}
    for a, b in zip(quant.model.layers, plain.model.layers):
        assert isinstance(a.mlp, FusedMoE)
        qa, qb = a.mlp.experts, b.mlp.experts
        if HAS_CC:
            assert qa.packed13.kind == GGUF_BLOCKS[kinds["ffn_gate_exps"]][0]
            assert qa.packed2.kind == GGUF_BLOCKS[kinds["ffn_down_exps"]][0]
            assert qb.packed13.kind == qb.packed2.kind == F32_KIND  # dequantized: float32 panels
            assert torch.equal(qa.packed13.dequantize(), qb.packed13.dequantize())
            assert torch.equal(qa.packed2.dequantize(), qb.packed2.dequantize())
    seq = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    for model in (quant, plain):
        model.pack_cpu_weights()
        pool = Pool(model)
        row = pool.add(len(seq))
        logits.append(model.forward(pool.batch([(row, seq, len(seq))], all_logits=True), pool.kv))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize(
    ("arch", "qtype", "size"), [("qwen3_moe", "Q8_0", "tiny"), ("mixtral", "Q4_K_M", "small")]
)
def test_engine_on_the_gguf_gives_transformers_tokens_on_its_converted_directory(
    arch: str, qtype: str, size: str, moe_gguf, launch_client, tmp_path
) -> None:
    """The engine runs the .gguf from its blocks; transformers runs `tandem convert`'s float32 directory of
    the
    same file (every expert weight in it): greedy tokens equal up to near-ties."""
    path = moe_gguf(arch, qtype, size)
    directory = convert(path, tmp_path / "converted")
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    client = launch_client(path, max_num_batched_tokens=64)
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 9, 40, 130)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = client.generate_batch(prompts, params, progress=False)
    assert_parity_floor([(o.token_ids, greedy(directory, p, 16), f"{arch} {qtype} len {len(p)}")
                         for p, o in zip(prompts, outs, strict=True)], max_detours=1)
    check_idle_engine(client)


@needs_c_kernels  # the blocks stay quantized where the C kernels run
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_take_their_expert_blocks(rank: int, moe_gguf, monkeypatch) -> None:
    """A rank's slice of every expert cut from the blocks as from a float weight (Q8_0's 32-input blocks: the
    down projection's 32 inputs a rank stay blocks)."""
    path = str(moe_gguf("qwen3_moe", "Q8_0"))
    quant = load_model(path, torch.float32, "cpu", tp_rank=rank, tp_size=2)
    monkeypatch.setattr(loader, "quantized_types", lambda *a: frozenset())
    plain = load_model(path, torch.float32, "cpu", tp_rank=rank, tp_size=2)
    for a, b in zip(quant.model.layers, plain.model.layers):
        qa, qb = a.mlp.experts, b.mlp.experts
        assert qa.packed13.kind == qa.packed2.kind == GGUF_BLOCKS["Q8_0"][0]
        assert torch.equal(qa.packed13.dequantize(), qb.packed13.dequantize())
        assert torch.equal(qa.packed2.dequantize(), qb.packed2.dequantize())


def test_expert_count_that_does_not_match_the_tensors_is_a_one_line_error(tiny_model, tmp_path) -> None:
    bad = write_gguf(tiny_model("qwen3_moe"), tmp_path / "bad.gguf", "Q8_0", expert_count=6)
    expect = "qwen3moe.expert_count = 6 does not match tensor blk.0.ffn_gate_exps.weight (shape [64, 64, 8])"
    with pytest.raises(ModelLoadError, match=re.escape(expect)):
        read_model_info(bad)
    r = subprocess.run([sys.executable, "-m", "tandem.launch.cli", "serve", "--model", str(bad)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 1
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expect in lines[0] and "Traceback" not in r.stderr, r.stderr

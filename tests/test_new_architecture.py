"""A new model costs its model class and one entry in protocol/architectures.py (and a make-model preset to
test it): nothing else in the engine names architectures. Here the class lives in this test module, the entry
is added for the test, and the engine runs it end to end (config read, weights loaded, scheduled decode
steps) against transformers running the same math written as a plain Llama."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import SamplingParams
from tandem.protocol import architectures
from tandem.protocol.architectures import ATTENTION, MLP, NORMS, Architecture
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.model_info import read_model_info
from tandem.worker.model_runner import ModelRunner
from tandem.worker.models.llama import LlamaForCausalLM, LlamaMLP
from tandem.worker.models.registry import get_model_class
from tests.reference import assert_greedy_parity, greedy
from tests.step_loop import generate


class ScaledMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).mul_(4.0)


class ScaledMLPForCausalLM(LlamaForCausalLM):
    """A Llama whose MLP output joins the residual stream at four times its weight."""

    def make_mlp(self, cfg, layer_id, dtype, device, ops, tp_rank, tp_size):
        return ScaledMLP(cfg, dtype, device, ops, tp_rank, tp_size)


ENTRY = Architecture("ScaledMLPForCausalLM", f"{__name__}:ScaledMLPForCausalLM", "llama", NORMS + ATTENTION + MLP)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(architectures.ARCHITECTURES, ENTRY.name, ENTRY)
    get_model_class.cache_clear()
    yield
    get_model_class.cache_clear()


def test_a_new_architecture_is_its_class_and_one_entry(registered, tiny_model, tmp_path: Path) -> None:
    src = tiny_model("llama")
    ours = tmp_path / "scaled-mlp"
    shutil.copytree(src, ours)
    cfg = json.loads((ours / "config.json").read_text())
    (ours / "config.json").write_text(json.dumps({**cfg, "architectures": [ENTRY.name]}))
    # The reference: transformers' Llama with every down_proj times 4 (a power of two: the same products).
    ref_dir = tmp_path / "reference"
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)  # its own copy: hf_model's is shared
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
    ref.save_pretrained(ref_dir)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, ref_dir / f.name)

    engine_cfg = EngineConfig(model=str(ours), dtype="float32", kv_cache_tokens=4096, max_running_requests=8)
    info = read_model_info(engine_cfg.model)
    runner = ModelRunner(engine_cfg, info)
    assert type(runner.model) is ScaledMLPForCausalLM
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (4, 19, 33)]
    outs = generate(engine_cfg, info, runner, prompts, [SamplingParams(max_tokens=12, temperature=0.0,
                                                                       ignore_eos=True)])
    equal = sum(assert_greedy_parity(outs[f"r{i}"], greedy(ref_dir, p, 12), f"prompt {i}")
                for i, p in enumerate(prompts))
    assert equal >= 2
    # and the plain Llama's tokens differ: the new class's own math ran
    plain = [greedy(src, p, 12).tokens for p in prompts]
    assert plain != [outs[f"r{i}"] for i in range(len(prompts))]


def test_an_architecture_without_an_entry_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unsupported model architecture 'ScaledMLPForCausalLM'"):
        get_model_class("ScaledMLPForCausalLM")

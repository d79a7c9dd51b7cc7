"""worker/step_recorder.py: the CPU step graph is recorded from the model's own forward. A Llama-shaped model
whose forward computes something else is replayed with its own math, bit for bit; a forward reaching an op
with no node (torch math in a layer, a node kind removed) is not recorded at all, and says which op."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.native import step_graph
from tandem.kernels.ops import resolve_ops
from tandem.protocol.engine_config import EngineConfig
from tandem.worker import cpu_step_graph
from tandem.worker.cpu_step_graph import CpuStepGraph, cpu_graph_applies
from tandem.worker.layers import RMSNorm
from tandem.worker.loader import load_model
from tandem.worker.models.llama import LlamaDecoderLayer, LlamaMLP
from tandem.worker.step_recorder import StepRecorder, Unrecordable
from tests.c_kernels import needs_c_kernels
from tests.kernels.test_cpu_step_graph import _prefilled, _step_both_ways
from tests.kv_pool import Pool

pytestmark = needs_c_kernels
ROOT = Path(__file__).resolve().parents[2]


class BranchNormLayer(LlamaDecoderLayer):
    """Llama's layer with its attention output normed before it joins the residual stream (where Gemma and
    OLMo-2 norm it), through the ops like any norm: other math, the same shapes and module names."""

    def forward(self, h: torch.Tensor, *attn_args) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), *attn_args)
        x = self.post_attention_layernorm.add_forward(h, self.branch_norm(a))
        return h.add_(self.mlp(x))


class HalfResidualLayer(LlamaDecoderLayer):
    """A scaled residual: the MLP's output joins the stream at half weight (torch's add_ with alpha)."""

    def forward(self, h: torch.Tensor, *attn_args) -> torch.Tensor:
        x = self.post_attention_layernorm.add_forward(h, self.self_attn(self.input_layernorm(h), *attn_args))
        return h.add_(self.mlp(x), alpha=0.5)


class TorchGeluMLP(LlamaMLP):
    """Another activation, computed in torch (GELU of the gate, exact form) instead of through the ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate) * up)


class ScaledMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).mul_(0.5)


def _model(tiny_model, arch: str = "llama"):
    model = load_model(
        str(tiny_model(arch)), torch.float32, "cpu", ops=resolve_ops("cpu", torch.float32, "cpu")
    )
    model.pack_cpu_weights()  # float weights the C kernel takes: every product a node
    return model


def _branch_norms(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        layer.__class__ = BranchNormLayer
        norm = layer.input_layernorm
        layer.branch_norm = RMSNorm(norm.weight.shape[0], norm.eps, torch.float32, "cpu", norm.ops)
        layer.branch_norm.weight.data = 0.5 + torch.rand(norm.weight.shape, generator=g)


def test_a_llama_shaped_model_with_other_math_replays_its_own_math(tiny_model) -> None:
    """The branch norm records as one more node a layer, and the replay equals the changed forward bit for
    bit (logits, argmax and every K/V) at batch sizes up and down, while the changed forward's logits differ
    from Llama's: the replay follows the forward, not Llama's shape."""
    plain, model = _model(tiny_model), _model(tiny_model)
    _branch_norms(model, seed=1)
    pool, plain_pool = Pool(model, num_slots=600), Pool(plain, num_slots=600)
    assert cpu_graph_applies(EngineConfig(model="unused"), model, pool.kv)
    graph = CpuStepGraph(model, pool.kv, max_batch=8, max_context=128)
    plain_graph = CpuStepGraph(plain, plain_pool.kv, max_batch=8, max_context=128)
    kinds, plain_kinds = graph.nodes[:, 0], plain_graph.nodes[:, 0]
    layers = model.config.num_hidden_layers
    assert int((kinds == step_graph.NORM).sum()) == int((plain_kinds == step_graph.NORM).sum()) + layers
    assert len(kinds) == len(plain_kinds) + layers
    lens = [3, 9, 14, 20, 6, 11, 2, 30]
    seqs, rows = _prefilled(model, pool, lens, seed=3, extra=4)
    _, plain_rows = _prefilled(plain, plain_pool, lens, seed=3, extra=4)
    done = list(lens)
    for size in (1, 8, 3):
        batch = pool.batch([(rows[i], [seqs[i][done[i]]], done[i] + 1) for i in range(size)])
        _step_both_ways(model, pool, graph, batch, "llama")
        ours = graph.run(batch).clone()
        theirs = plain.forward(plain_pool.batch([(plain_rows[i], [seqs[i][done[i]]], done[i] + 1)
                                                 for i in range(size)]), plain_pool.kv)
        assert not torch.allclose(ours, theirs, atol=1e-3)
        for i in range(size):
            done[i] += 1


@pytest.mark.parametrize("change,op", [
    ("half_residual", "aten.add_.Tensor"), ("torch_gelu", "aten.gelu.default"), ("scaled_mlp", "aten.mul_"),
])
def test_torch_math_in_the_forward_refuses_the_recording_and_names_the_op(tiny_model, caplog, monkeypatch,
                                                                          change: str, op: str) -> None:
    """The refused model still runs its forward eagerly; the graph is not recorded (CpuStepGraph raises,
    cpu_graph_applies says no and logs the op once)."""
    model = _model(tiny_model)
    for layer in model.model.layers:
        if change == "half_residual":
            layer.__class__ = HalfResidualLayer
        else:
            layer.mlp.__class__ = TorchGeluMLP if change == "torch_gelu" else ScaledMLP
    pool = Pool(model)
    _prefilled(model, pool, [4, 7], seed=2, extra=1)  # the eager forward runs
    with pytest.raises(Unrecordable, match=op.split(".")[1]):
        CpuStepGraph(model, pool.kv, max_batch=4, max_context=64)
    monkeypatch.setattr(cpu_step_graph, "_told", set())  # logged once per process: this one's first
    with caplog.at_level(logging.INFO, logger="tandem.worker.cpu_step_graph"):
        assert not cpu_graph_applies(EngineConfig(model="unused"), model, pool.kv)
        assert not cpu_graph_applies(EngineConfig(model="unused"), model, pool.kv)
    assert len([r for r in caplog.records if op in r.getMessage()]) == 1


def test_removing_a_node_kind_makes_recording_refuse(tiny_model, monkeypatch) -> None:
    """Gemma's GeGLU with its recorder removed: Gemma 3 is not recorded (the op is named), Llama still is."""
    monkeypatch.setattr(StepRecorder, "RECORDERS", {k: v for k, v in StepRecorder.RECORDERS.items()
                                                    if k != "gelu_mul"})
    gemma, llama = _model(tiny_model, "gemma3"), _model(tiny_model)
    with pytest.raises(Unrecordable, match="Ops.gelu_mul"):
        CpuStepGraph(gemma, Pool(gemma).kv, max_batch=2, max_context=64)
    assert not cpu_graph_applies(EngineConfig(model="unused"), gemma, Pool(gemma).kv)
    assert cpu_graph_applies(EngineConfig(model="unused"), llama, Pool(llama).kv)


def test_the_recording_has_no_code_of_any_model() -> None:
    """No model is imported or named in code where the graph is recorded or replayed: what it records is what
    the forward runs."""
    for name in ("worker/step_recorder.py", "worker/cpu_step_graph.py"):
        tree = ast.parse((ROOT / name).read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not [m for m in imported if m and ".models" in m], name
        assert not [n for n in names if "ForCausalLM" in n or n.startswith(("Gemma", "Llama", "Qwen"))], name


def test_recording_does_not_import_dynamo(tiny_model) -> None:
    """torch wraps a dispatch mode's __torch_dispatch__ in torch._dynamo.disable unless the mode opts out, and
    the wrapper's first call imports torch._dynamo (1.2 s of a worker's start): the recorder's mode opts out.
    In a fresh process, since any earlier test may have imported it."""
    code = f"""
import sys
from tandem.worker.cpu_step_graph import CpuStepGraph
from tests.kernels.test_step_recorder import _model
from tests.kv_pool import Pool
model = _model(lambda arch: {str(tiny_model("llama"))!r})
assert "torch._dynamo" not in sys.modules, "imported before the recording"
CpuStepGraph(model, Pool(model).kv, max_batch=2, max_context=64)
assert "torch._dynamo" not in sys.modules, "the recording imported torch._dynamo"
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]

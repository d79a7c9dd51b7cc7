"""worker/cpu_step_graph.py: a recorded CPU decode step replayed with one call gives the eager forward's bits
(logits and every K/V it writes), for each architecture (Gemma 3's sliding layers past their window, in the
shared pool and in a pool of their own), batch sizes up and down, and through the worker's step loop with
page sizes 1 and 16; it applies only where every op has a C kernel."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.kernels.native import paged_attention, step_graph
from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.kv_quant import Q8_0
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.model_info import read_model_info
from tandem.worker.cpu_step_graph import CpuStepGraph, cpu_graph_applies
from tandem.worker.loader import load_model
from tandem.worker.model_runner import ModelRunner
from tests.c_kernels import needs_c_kernels
from tests.kv_pool import Pool
from tests.step_loop import generate

pytestmark = needs_c_kernels


def _prefilled(
    model, pool: Pool, lens: list[int], seed: int, extra: int
) -> tuple[list[list[int]], list[int]]:
    """Random prompts of `lens` tokens (each with `extra` more to decode), prefilled eagerly into the pool."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 500, (n + extra,), generator=g).tolist() for n in lens]
    rows = [pool.add(len(s)) for s in seqs]
    model.forward(pool.batch([(r, s[:n], n) for r, s, n in zip(rows, seqs, lens, strict=True)]), pool.kv)
    return seqs, rows


def _kv(pool: Pool) -> list[torch.Tensor]:
    return [t.clone() for t in pool.kv.k + pool.kv.v]


def _step_both_ways(model, pool: Pool, graph: CpuStepGraph, batch, arch: str, head_node=None) -> None:
    """One decode step eagerly, the pools put back, then replayed: the same logits bit for bit, the step's
    K/V where eager wrote them (no other slot touched), and the argmax node's greedy tokens those of the
    logits (no such node for Gemma, whose softcap comes after the head). head_node (a monkeypatch): the
    replay must not call compute_logits."""
    before = _kv(pool)
    eager = model.forward(batch, pool.kv)
    after_eager = _kv(pool)
    for t, b in zip(pool.kv.k + pool.kv.v, before, strict=True):
        t.copy_(b)
    assert graph.can_run(batch)
    if head_node is None:
        replayed = graph.run(batch)
    else:
        with head_node.context() as m:
            m.setattr(model, "compute_logits", lambda h: pytest.fail("the LM head should be a node"))
            replayed = graph.run(batch)
    size = batch.batch_size
    assert torch.equal(replayed, eager), (size, (replayed - eager).abs().max())
    greedy = graph.greedy_tokens(size)
    assert (greedy is None) == (arch == "gemma3") and (
        greedy is None or torch.equal(greedy, eager.argmax(-1))
    )
    assert all(torch.equal(a, b) for a, b in zip(_kv(pool), after_eager, strict=True))


@pytest.mark.parametrize("arch,qtype,kv_dtype,int8,swa", [
    ("llama", "Q4_1", torch.float32, False, False), ("qwen2", "Q8_0", torch.float32, False, False),
    ("qwen3", "Q4_0", torch.float32, False, False), ("qwen2", "Q4_K_M", torch.float32, False, False),
    ("llama", "Q4_1", torch.float16, False, False), ("qwen3", "Q4_0", torch.bfloat16, False, False),
    ("llama", "Q4_1", torch.float32, True, False), ("qwen2", "Q4_K_M", torch.float32, True, False),
    # MoE layers: one node each, the C layer's call (routing included)
    ("qwen3_moe", "Q4_0", torch.float32, False, False), ("mixtral", "Q8_0", torch.float16, False, False),
    ("qwen3_moe", "Q4_K_M", torch.float32, False, False),
    ("gemma3", "Q8_0", torch.float32, False, False), ("gemma3", "Q8_0", torch.float32, False, True),
    ("gemma3", "Q4_K_M", torch.bfloat16, False, True),
    # q8_0 KV blocks (head sizes of 32: the small qwen2, the tiny Gemma 3 with its sliding layers' own pool)
    ("qwen2", "Q4_K_M", Q8_0, False, False), ("gemma3", "Q8_0", Q8_0, False, True)])
def test_replay_equals_eager_bit_for_bit(gguf_model, arch: str, qtype: str, kv_dtype: torch.dtype,
                                         int8: bool, swa: bool) -> None:
    """int8: --cpu-int8-activations, whose nodes call the int8 entry the eager products call. swa: the
    sliding layers' KV in a pool of their own (Gemma 3; windows of 16 and 32, passed by the decodes)."""
    model = load_model(str(gguf_model(arch, qtype)), torch.float32, "cpu",
                       ops=resolve_ops("cpu", torch.float32, "cpu", int8_activations=int8))
    assert all(m.int8_activations == int8 for m in model.modules() if hasattr(m, "int8_activations"))
    model.pack_cpu_weights()
    pool = Pool(model, num_slots=600, max_reqs=16, kv_dtype=kv_dtype, swa=swa)
    cfg = EngineConfig(model="unused")
    assert cpu_graph_applies(cfg, model, pool.kv)
    graph = CpuStepGraph(model, pool.kv, max_batch=8, max_context=128)
    lens = [3, 9, 14, 20, 6, 11, 2, 30]
    seqs, rows = _prefilled(model, pool, lens, seed=3, extra=12)
    done = list(lens)
    for size in (1, 7, 3, 8, 2, 5):  # down and up: rows a larger batch left in the buffers are not read
        _step_both_ways(model, pool, graph, pool.batch([(rows[i], [seqs[i][done[i]]], done[i] + 1)
                                                        for i in range(size)]), arch)
        for i in range(size):
            done[i] += 1
    assert graph.num_runs == 6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_write_rounds_like_torch(dtype: torch.dtype) -> None:
    """The graph's K/V store into a half pool gives torch's .to(dtype) bits: ties to even, subnormals,
    overflow to inf, signed zeros, infinities, NaN."""
    g = torch.Generator().manual_seed(0)
    edge = [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.99, 65520.0, -1e6, 6e-8, 3e-8, 2.9802322e-08, 5.9604645e-08,
            6.1035156e-05, 6.1e-05, 1e-40, -1e-45, 1.0009765625, 1.00048828125, 1.00146484375, 1.00390625,
            1.001953125, 3.3895314e38, float("inf"), float("-inf"), float("nan")]
    rand = torch.randn(1000, generator=g) * torch.logspace(-9, 6, 1000)
    bits = torch.randint(-(2**31), 2**31 - 1, (1000,), generator=g, dtype=torch.int64).to(torch.int32)
    src = torch.cat([torch.tensor(edge), rand, bits.view(torch.float32)])
    src = torch.where(src.isnan(), torch.full_like(src, float("nan")), src)  # torch keeps one NaN pattern
    width = 32
    src = torch.cat([src, src.new_zeros(-src.numel() % width)]).view(-1, width)
    rows = src.shape[0]
    kp, vp = torch.zeros(rows + 3, width, dtype=dtype), torch.zeros(rows + 3, width, dtype=dtype)
    slots = torch.randperm(rows + 3, generator=g)[:rows].contiguous()
    node = [
        step_graph.KV_WRITE,
        src.data_ptr(),
        width,
        (-src).data_ptr(),
        width,
        kp.data_ptr(),
        vp.data_ptr(),
        width,
        slots.data_ptr(),
        paged_attention.KV_TYPES[dtype],
    ]
    neg = -src
    node[3] = neg.data_ptr()
    step_graph.run(torch.tensor([node + [0] * (step_graph.NODE_ARGS + 1 - len(node))]), rows, 1)
    want_k, want_v = torch.zeros_like(kp), torch.zeros_like(vp)
    want_k[slots], want_v[slots] = src.to(dtype), neg.to(dtype)
    assert torch.equal(kp.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(vp.view(torch.int16), want_v.view(torch.int16))


def test_only_decode_batches_within_max_batch_are_taken(gguf_model) -> None:
    model = load_model(str(gguf_model("llama")), torch.float32, "cpu")
    pool = Pool(model)
    graph = CpuStepGraph(model, pool.kv, max_batch=2, max_context=128)
    a, b, c = pool.add(8), pool.add(8), pool.add(8)
    assert not graph.can_run(pool.batch([(a, [1, 2, 3], 3)]))  # a prefill
    assert not graph.can_run(pool.batch([(a, [1], 4), (b, [2], 4), (c, [3], 4)]))  # past max_batch
    with pytest.raises(ValueError):
        graph.run(pool.batch([(a, [1, 2, 3], 3)]))


def test_applies_only_where_every_op_has_a_c_kernel(gguf_model, tiny_model) -> None:
    path = str(gguf_model("llama"))
    cpu = resolve_ops("cpu", torch.float32, "cpu")
    quant = load_model(path, torch.float32, "cpu", ops=cpu)
    kv = Pool(quant).kv
    assert cpu_graph_applies(EngineConfig(model=path), quant, kv)
    assert not cpu_graph_applies(EngineConfig(model=path, enforce_eager=True), quant, kv)
    torch_backend = load_model(path, torch.float32, "cpu", ops=resolve_ops("cpu", torch.float32, "torch"))
    assert not cpu_graph_applies(EngineConfig(model=path), torch_backend, Pool(torch_backend).kv)
    plain = load_model(str(tiny_model("llama")), torch.float32, "cpu", ops=cpu)  # float weights: the C kernel
    plain.pack_cpu_weights()
    assert cpu_graph_applies(EngineConfig(model=path), plain, Pool(plain).kv)
    half = load_model(
        str(tiny_model("llama")), torch.bfloat16, "cpu", ops=resolve_ops("cpu", torch.bfloat16, "cpu")
    )
    half.pack_cpu_weights()  # bf16 activations: torch's ops, no C kernel takes them
    assert not cpu_graph_applies(EngineConfig(model=path), half, Pool(half).kv)


@pytest.mark.parametrize("arch,weights,kv_dtype,tie", [
    ("llama", torch.float32, torch.float32, None), ("llama", torch.bfloat16, torch.float32, None),
    ("qwen2", torch.bfloat16, torch.float16, None), ("qwen3", torch.float32, torch.bfloat16, False),
    ("qwen3", torch.bfloat16, torch.float32, False), ("gemma3", torch.bfloat16, torch.float32, None)])
def test_float_models_replay_their_eager_bits(tiny_model, arch: str, weights: torch.dtype,
                                              kv_dtype: torch.dtype, tie: bool | None, monkeypatch) -> None:
    """A float checkpoint's layers (float32 weights, or bf16 weights under float32 activations: --dtype
    auto on a CPU with bf16 matmuls) run from the C kernel's float kinds: the replay gives the eager bits,
    the LM head (tied or not) is a node, and a recording serves the rows the kernel takes for such weights
    (DENSE_MAX_ROWS: 8 for bf16), past which the eager step multiplies in torch."""
    model = load_model(str(tiny_model(arch, tie_embeddings=tie) if tie is not None else tiny_model(arch)),
                       torch.float32, "cpu", ops=resolve_ops("cpu", torch.float32, "cpu"))
    model.pack_cpu_weights(weights)
    layers = [m for m in model.modules() if hasattr(m, "dense") and m.dense is not None]
    assert layers and all(m.dense.data.dtype == weights and m.quant is None for m in layers)
    pool = Pool(model, num_slots=900, max_reqs=40, kv_dtype=kv_dtype)
    assert cpu_graph_applies(EngineConfig(model="unused"), model, pool.kv)
    graph = CpuStepGraph(model, pool.kv, max_batch=32, max_context=128)
    assert graph.max_batch == (8 if weights == torch.bfloat16 else 32) and graph.logits is not None
    lens = [3, 9, 14, 20, 6, 11, 2, 30, *range(4, 29)]
    seqs, rows = _prefilled(model, pool, lens, seed=3, extra=6)
    done = list(lens)
    for size in (1, 8, 3, 5, min(20, graph.max_batch)):
        _step_both_ways(model, pool, graph, pool.batch([(rows[i], [seqs[i][done[i]]], done[i] + 1)
                                                        for i in range(size)]), arch, monkeypatch)
        for i in range(size):
            done[i] += 1
    too_many = pool.batch([(rows[i], [seqs[i][done[i]]], done[i] + 1) for i in range(graph.max_batch + 1)])
    assert not graph.can_run(too_many)


@pytest.mark.parametrize(
    "arch,page_size,kv,int8",
    [
        ("llama", 1, "auto", False),
        ("llama", 16, "auto", False),
        ("qwen3", 1, "auto", False),
        ("qwen3", 16, "float16", False),
        ("qwen3", 1, "auto", True),
        ("gemma3", 1, "auto", False),
        ("gemma3", 16, "float16", False),
        ("gemma3", 16, "q8_0", False),
    ],
)
def test_worker_steps_through_the_graph_give_the_eager_tokens(gguf_model, arch: str, page_size: int, kv: str,
                                                              int8: bool) -> None:
    path = str(gguf_model(arch))
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=4, repetition_penalty=1.2, ignore_eos=True)]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 2)]
    outs = {}
    for eager in (True, False):
        cfg = EngineConfig(
            model=path,
            dtype="float32",
            kv_cache_tokens=4096,
            max_running_requests=8,
            page_size=page_size,
            enforce_eager=eager,
            kv_cache_dtype=kv,
            cpu_int8_activations=int8,
        )
        runner = ModelRunner(cfg, read_model_info(cfg.model))
        outs[eager] = generate(cfg, read_model_info(cfg.model), runner, prompts, params)
        assert (isinstance(runner.graphs, CpuStepGraph) and runner.graphs.num_runs > 0) == (not eager)
        assert runner.ops.int8_activations == int8
    assert outs[True] == outs[False]
    assert sum(map(len, outs[False].values())) == 3 * 12 + 2 * 9


@pytest.mark.parametrize("arch,source", [("llama", "gguf"), ("qwen3", "dir"), ("gemma3", "dir")])
def test_greedy_steps_take_the_replays_argmax(
    gguf_model, tiny_model, arch: str, source: str, monkeypatch
) -> None:
    """All-greedy decode steps through the graph take their tokens from its argmax node (the sampler is not
    called for them) and give the eager tokens; Gemma's softcapped logits go through the sampler; float
    directories at `--dtype auto` (bf16 weights where the CPU has bf16 matmuls) step through the graph too."""
    import tandem.worker.model_runner as mr

    path = str(gguf_model(arch) if source == "gguf" else tiny_model(arch))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 40)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    outs, calls = {}, {}
    real = mr.sample
    for eager in (True, False):
        count = [0]

        def counted(*a, count=count, **k):
            count[0] += 1
            return real(*a, **k)

        monkeypatch.setattr(mr, "sample", counted)
        cfg = EngineConfig(model=path, kv_cache_tokens=4096, max_running_requests=8, enforce_eager=eager)
        runner = ModelRunner(cfg, read_model_info(cfg.model))
        outs[eager] = generate(cfg, read_model_info(cfg.model), runner, prompts, params)
        assert isinstance(runner.graphs, CpuStepGraph) != eager and (eager or runner.graphs.num_runs >= 8)
        calls[eager] = count[0]
    assert outs[True] == outs[False] and sum(map(len, outs[False].values())) == 3 * 10
    if arch == "gemma3":
        assert calls[False] == calls[True]
    else:  # only the steps that did not replay (prefills) sampled through torch
        assert calls[False] <= calls[True] - 8


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_models_run_alike_with_the_graph_or_without(gguf_model, arch: str) -> None:
    """Qwen3-MoE's MoE layers are recorded (one node each); Qwen2-MoE's shared expert is not, so its model
    declines the graph and steps eagerly: both give the eager tokens."""
    path = str(gguf_model(arch))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 40)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    outs = {}
    for eager in (True, False):
        cfg = EngineConfig(model=path, dtype="float32", kv_cache_tokens=4096, max_running_requests=8,
                           enforce_eager=eager)
        runner = ModelRunner(cfg, read_model_info(cfg.model))
        assert cpu_graph_applies(cfg, runner.model, runner.kv) == (not eager and arch == "qwen3_moe")
        outs[eager] = generate(cfg, read_model_info(cfg.model), runner, prompts, params)
        recorded = isinstance(runner.graphs, CpuStepGraph)
        assert recorded == (not eager and arch == "qwen3_moe") and (
            not recorded or runner.graphs.num_runs > 0
        )
    assert outs[True] == outs[False] and sum(map(len, outs[False].values())) == 3 * 10

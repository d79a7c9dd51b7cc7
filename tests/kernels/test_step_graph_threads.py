"""The recorded CPU decode step on a team of 1 to 4 threads gives the same bits as the eager forward: one
region per step, attention split over (request, KV head) items at long contexts, and every elementwise node
(norms with and without a folded residual add, rotary, the activation, a bare add) split over rows once it
passes PARALLEL_MIN_ELEMS. The small batches and short contexts of test_cpu_step_graph.py keep those on one
thread."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tandem.kernels.native import step_graph
from tandem.kernels.ops import resolve_ops
from tandem.kernels.reference.kv_quant import Q8_0
from tandem.worker.cpu_step_graph import CpuStepGraph
from tandem.worker.loader import load_model
from tests.c_kernels import needs_c_kernels
from tests.kernels.test_cpu_step_graph import _kv, _prefilled, _step_both_ways
from tests.kv_pool import Pool

pytestmark = needs_c_kernels


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's (and so the replay's) team size for the block, put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("arch,qtype,int8", [("llama", "Q4_1", False), ("qwen2", "Q4_K_M", True),
                                             ("gemma3", "Q8_0", False)])
def test_one_region_gives_the_same_bits_on_any_thread_count(gguf_model, arch: str, qtype: str, int8: bool,
                                                             monkeypatch) -> None:
    """The replay runs the step in one parallel region, each node split over the team by its kernel's part:
    1 to 4 threads (more than the cores, so threads wait at barriers) give the same logits and K/V, and
    the LM head is a node (compute_logits is not called)."""
    model = load_model(str(gguf_model(arch, qtype)), torch.float32, "cpu",
                       ops=resolve_ops("cpu", torch.float32, "cpu", int8_activations=int8))
    model.pack_cpu_weights()
    pool = Pool(model, num_slots=600, max_reqs=16)
    with _torch_threads(4):
        graph = CpuStepGraph(model, pool.kv, max_batch=8, max_context=128)
    assert graph.threads == 4 and graph.logits is not None
    lens = [5, 17, 2, 40, 9, 23, 1, 12]
    seqs, rows = _prefilled(model, pool, lens, seed=5, extra=1)
    monkeypatch.setattr(model, "compute_logits", lambda h: pytest.fail("the LM head should be a node"))
    start = _kv(pool)
    results: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for threads in (1, 2, 3, 4):
        for t, b in zip(pool.kv.k + pool.kv.v, start, strict=True):
            t.copy_(b)
        with _torch_threads(threads):
            for size in (8, 3, 1):  # each a step of its own, from the same KV: one slot written per row
                batch = pool.batch([(rows[i], [seqs[i][lens[i]]], lens[i] + 1) for i in range(size)])
                results[threads, size] = graph.run(batch).clone(), _kv(pool)
    for (threads, size), (logits, kv) in results.items():
        want_logits, want_kv = results[1, size]
        assert torch.equal(logits, want_logits), (threads, size)
        assert all(torch.equal(a, b) for a, b in zip(kv, want_kv, strict=True)), (threads, size)


@pytest.mark.parametrize("arch,qtype,kv_dtype", [("llama", "Q4_1", None), ("gemma3", "Q8_0", None),
                                                 ("gemma3", "Q8_0", Q8_0)])
def test_split_attention_gives_the_same_bits_on_any_thread_count(gguf_model, arch: str, qtype: str,
                                                                 kv_dtype: torch.dtype | None, monkeypatch) -> None:
    """Contexts long enough that the attention node splits its (request, KV head) items over the team (the
    short contexts above keep it on one thread): 1 to 4 threads give the eager step's logits and K/V, bit
    for bit; Gemma's sliding layers read their last window of these long contexts; kv_dtype: the pools'
    (None: the model's; q8_0 blocks)."""
    from tandem.kernels.native.paged_attention import PARALLEL_MIN_KEYS

    model = load_model(str(gguf_model(arch, qtype)), torch.float32, "cpu", ops=resolve_ops("cpu", torch.float32, "cpu"))
    model.pack_cpu_weights()
    lens = [300, 17, 520, 40, 260, 1, 410, 12]
    kv_heads = model.config.num_key_value_heads
    # the C rule: min(threads, items, keys x KV heads / PARALLEL_MIN_KEYS) threads share the items
    assert min(len(lens) * kv_heads, (sum(lens) + len(lens)) * kv_heads // PARALLEL_MIN_KEYS) >= 4
    pool = Pool(model, num_slots=2400, max_reqs=16, max_context=600, kv_dtype=kv_dtype)
    with _torch_threads(4):
        graph = CpuStepGraph(model, pool.kv, max_batch=8, max_context=600)
    seqs, rows = _prefilled(model, pool, lens, seed=11, extra=1)
    batch = pool.batch([(rows[i], [seqs[i][lens[i]]], lens[i] + 1) for i in range(len(lens))])
    for threads in (1, 2, 3, 4):
        with _torch_threads(threads):
            _step_both_ways(model, pool, graph, batch, arch)  # puts the pools back before replaying


def _parallel_min_elems() -> int:
    """The replayer's rule, read from its source: an elementwise node under this many elements runs on one
    thread (so a change there cannot leave the tests below on one thread unnoticed)."""
    found = re.search(r"#define PARALLEL_MIN_ELEMS \(1 << (\d+)\)", step_graph.SOURCE.read_text())
    assert found, "PARALLEL_MIN_ELEMS is no longer defined as (1 << k) in step_graph.c"
    return 1 << int(found[1])


# The nodes split only past PARALLEL_MIN_ELEMS (step_graph.c's `elementwise`), and their elements per row.
_ELEMENTWISE = {
    step_graph.NORM: lambda a: a["n"],
    step_graph.ROTARY: lambda a: a["H"] * a["D"],
    step_graph.SILU_MUL: lambda a: a["n"],
    step_graph.GELU_MUL: lambda a: a["n"],
    step_graph.ADD: lambda a: a["n"],
}


@pytest.mark.parametrize("arch,qtype,kinds", [
    pytest.param("llama", "Q4_1", {step_graph.NORM, step_graph.ROTARY, step_graph.SILU_MUL}, id="llama"),
    pytest.param("gemma3", "Q8_0", {step_graph.NORM, step_graph.ROTARY, step_graph.GELU_MUL}, id="gemma3")])
def test_split_elementwise_nodes_give_the_same_bits_on_any_thread_count(gguf_model, arch: str, qtype: str,
                                                                        kinds: set[int]) -> None:
    """A decode batch wide enough that every elementwise node (norms, the residual adds folded into them,
    rotary, the activation) splits its rows over the team (the small batches above keep each on one
    thread): 1 to 4 threads give the eager step's logits and K/V, bit for bit. The tiny models' narrowest
    node is Gemma's k rotary (one KV head of 32): 32 x 1027 rows; 1027 = 13 x 79, so no thread count
    divides it and every share ends inside the batch. A few contexts pass Gemma's sliding window."""
    model = load_model(str(gguf_model(arch, qtype)), torch.float32, "cpu", ops=resolve_ops("cpu", torch.float32, "cpu"))
    model.pack_cpu_weights()
    size = 1027
    lens = [20 if i % 50 == 0 else 1 + i % 5 for i in range(size)]
    pool = Pool(model, num_slots=sum(lens) + 4 * size, max_reqs=size, max_context=32)  # 4 tokens to decode
    with _torch_threads(4):
        graph = CpuStepGraph(model, pool.kv, max_batch=size, max_context=32)
    assert graph.max_batch == size
    nodes = [(n[0], dict(zip(step_graph.NAMES[n[0]], n[1:], strict=False))) for n in graph.nodes.tolist()]
    split = [(kind, size * _ELEMENTWISE[kind](a)) for kind, a in nodes if kind in _ELEMENTWISE]
    assert {kind for kind, _ in split} == kinds
    assert min(elems for _, elems in split) >= _parallel_min_elems(), split
    norms = [a for kind, a in nodes if kind == step_graph.NORM]
    assert any(a["delta"] for a in norms) and any(not a["delta"] for a in norms)  # with an add, and without
    seqs, rows = _prefilled(model, pool, lens, seed=13, extra=4)
    for threads in (1, 2, 3, 4):
        # Each its own next token at the same position: a row a wrong split leaves unwritten keeps the last
        # replay's values, not this step's.
        batch = pool.batch([(rows[i], [seqs[i][lens[i] + threads - 1]], lens[i] + 1) for i in range(size)])
        with _torch_threads(threads):
            _step_both_ways(model, pool, graph, batch, arch)  # puts the pools back before replaying


def test_split_add_node_gives_torch_bits() -> None:
    """A residual add no norm takes in (an ADD node; the recorded models fold theirs into the next norm)
    split over 1 to 4 threads: torch's add_ on every row, the columns past each row's n untouched."""
    rows, n = 259, 128  # 259 = 7 x 37: every share of 2..4 threads ends inside the batch
    assert rows * n >= _parallel_min_elems()
    g = torch.Generator().manual_seed(1)
    x0, d = torch.randn(rows, n + 8, generator=g), torch.randn(rows, n + 3, generator=g)
    want = x0.clone()
    want[:, :n].add_(d[:, :n])
    for threads in (1, 2, 3, 4):
        x = x0.clone()
        node = step_graph.Node(step_graph.ADD, x=x, ldx=x.stride(0), delta=d, ldd=d.stride(0), n=n)
        step_graph.run(torch.tensor([node.row(lambda p: int(p.base) + p.offset)]), rows, threads)
        assert torch.equal(x, want), threads

"""worker/decode_graphs.py on CPU: buckets, and the padded static decode batch (the path a CUDA graph
captures, run eagerly here) against the eager forward, for the logits and the KV it writes. The captured
graphs themselves: tests/kernels/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.kernels.ops import resolve_ops
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.model_info import read_model_info
from tandem.worker.attention_backend import select_attention_backend
from tandem.worker.decode_graphs import DecodeGraphs, decode_buckets, graphs_apply
from tandem.worker.forward_batch import ForwardBatch
from tandem.worker.loader import load_model
from tandem.worker.model_runner import ModelRunner
from tests.kernels.ops_variants import cpu_triton
from tests.kv_pool import Pool
from tests.step_loop import generate


@pytest.mark.parametrize("max_batch", [1, 2, 3, 8, 9, 16, 17, 100, 256])
def test_buckets_cover_every_batch_size(max_batch: int) -> None:
    buckets = decode_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
    for b in range(1, max_batch + 1):
        size = next(s for s in buckets if s >= b)
        assert size - b < max(16, b // 2 + 1)  # padding bounded: doubling up to 16, then steps of 16


def test_bad_buckets_and_capture_off_cuda_are_refused(tiny_model) -> None:
    with pytest.raises(ValueError):
        decode_buckets(0)
    model = load_model(tiny_model("llama"), torch.float32, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, Pool(model).kv, 4, 128, capture=True)


@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=cpu_triton)])
def test_padded_decode_equals_eager_and_writes_only_its_slots(tiny_model, backend: str) -> None:
    model = load_model(
        tiny_model("qwen3"), torch.float32, "cpu", ops=resolve_ops("cpu", torch.float32, backend)
    )
    pool = Pool(model, num_slots=600, max_reqs=16)
    pool.free_slots.remove(0)  # slot 0 is the engine's padding slot, never a request's
    graphs = DecodeGraphs(model, pool.kv, max_batch=12, max_context=128, capture=False)
    assert graphs.buckets == [1, 2, 4, 8, 12]
    g = torch.Generator().manual_seed(5)
    lens = [3, 9, 14, 20, 6, 11, 2]
    seqs = [torch.randint(0, 500, (n + 12,), generator=g).tolist() for n in lens]
    rows = [pool.add(len(s)) for s in seqs]
    model.forward(pool.batch([(r, s[:n], n) for r, s, n in zip(rows, seqs, lens, strict=True)]), pool.kv)
    done = list(lens)
    # Sizes down and up again: a smaller batch after a larger one must pad the rows it left behind.
    for size in (7, 3, 5, 1, 2, 7, 4):
        batch = pool.batch([(rows[i], [seqs[i][done[i]]], done[i] + 1) for i in range(size)])
        before = [k.clone() for k in pool.kv.k + pool.kv.v]
        eager = model.forward(batch, pool.kv)
        after_eager = [k.clone() for k in pool.kv.k + pool.kv.v]
        for t, b in zip(pool.kv.k + pool.kv.v, before, strict=True):
            t.copy_(b)
        assert graphs.can_run(batch)
        padded = graphs.run(batch)
        bucket = graphs.bucket(size)
        for name, pad in graphs._pads.items():  # the rows past the batch hold padding, not a stale request
            assert graphs._buf[name][size:bucket].eq(pad).all(), name
        torch.testing.assert_close(padded, eager, atol=1e-5, rtol=0)
        written = batch.out_cache_loc
        others = torch.ones(pool.kv.k[0].shape[0], dtype=torch.bool)
        others[written] = False
        others[0] = False  # the padding slot
        for t, want, old in zip(pool.kv.k + pool.kv.v, after_eager, before, strict=True):
            assert torch.equal(t[others], old[others])  # no other slot touched
            # The step's own K/V as the eager step wrote them (products of 8 rows, not 7: the last bits)
            torch.testing.assert_close(t[written], want[written], atol=1e-5, rtol=0)
        for i in range(size):
            done[i] += 1


def test_only_plain_decode_batches_are_taken(tiny_model) -> None:
    model = load_model(tiny_model("llama"), torch.float32, "cpu")
    pool = Pool(model)
    pool.free_slots.remove(0)
    graphs = DecodeGraphs(model, pool.kv, max_batch=2, max_context=128, capture=False)
    a, b, c = pool.add(8), pool.add(8), pool.add(8)
    assert not graphs.can_run(pool.batch([(a, [1, 2, 3], 3)]))  # a prefill
    assert not graphs.can_run(pool.batch([(a, [1], 4), (b, [2], 4), (c, [3], 4)]))  # past the largest bucket
    one_samples = ForwardBatch.from_lists([1, 2], [5, 6], [a, b], [4, 4], [1, 1], logits_indices=[1])
    assert not graphs.can_run(one_samples)  # a request whose row wants no logits (a prompt's middle chunk)
    with pytest.raises(ValueError):
        graphs.run(pool.batch([(a, [1, 2, 3], 3)]))


def test_runner_with_padded_decodes_generates_the_same_tokens(tiny_model) -> None:
    """The worker's step through the padded decode path (as on CUDA, without capture) against eager."""
    model = tiny_model("llama")
    cfg = EngineConfig(model=str(model), kv_cache_tokens=4096, max_running_requests=8)
    info = read_model_info(cfg.model)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.9, seed=4, repetition_penalty=1.3, ignore_eos=True)]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 2)]
    outputs = []
    for padded in (False, True):
        runner = ModelRunner(cfg, info)
        if padded:
            runner.graphs = DecodeGraphs(runner.model, runner.kv, 8, runner.max_context, capture=False)
        outputs.append(generate(cfg, info, runner, prompts, params))
        if padded:
            assert runner.graphs.num_runs >= 8  # the decode steps went through the padded path
    assert outputs[0] == outputs[1] and sum(map(len, outputs[0].values())) == 3 * 10 + 2 * 7


def test_graphs_apply_on_one_cuda_rank_with_triton_unless_eager(tiny_model) -> None:
    cuda_ops, cpu_ops = resolve_ops("cuda", torch.bfloat16, "triton"), resolve_ops("cpu", torch.float32, "cpu")
    assert cuda_ops.cuda_graphs and not cpu_ops.cuda_graphs  # the ops decide, from the device
    cfg = EngineConfig(model=str(tiny_model("llama")))
    triton = select_attention_backend(cuda_ops)
    torch_backend = select_attention_backend(resolve_ops("cuda", torch.bfloat16, "torch"))
    assert graphs_apply(cfg, cuda_ops, triton)
    assert not graphs_apply(cfg, cpu_ops, select_attention_backend(cpu_ops))
    assert not graphs_apply(cfg, cuda_ops, torch_backend)  # its plan is built from host lists each step
    assert not graphs_apply(EngineConfig(model=cfg.model, enforce_eager=True), cuda_ops, triton)
    assert not graphs_apply(EngineConfig(model=cfg.model, tp_size=2), cuda_ops, triton)

"""GPU-only checks (skipped without CUDA). Their CPU twins: tests/kernels/test_input_prep.py and
tests/kernels/test_sliding_window_attention.py (Triton kernels under the interpreter),
tests/test_e2e_parity.py,
tests/test_gemma3.py and tests/test_e2e_async.py (the engine on CPU)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from tandem import SamplingParams
from tests.conftest import check_idle_engine
from tests.reference import NEAR_TIE_BF16, assert_greedy_parity, assert_parity_floor, greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_triton_is_not_interpreted() -> None:
    """The kernels here run natively: no test module may have turned the interpreter on in this process
    (tests/kernels/conftest.py sets it only where there is no GPU)."""
    assert os.environ.get("TRITON_INTERPRET", "0") != "1"


def test_triton_input_prep_kernels_equal_references_on_cuda() -> None:
    from tandem.kernels.reference.input_prep import prepare_inputs_ref
    from tandem.kernels.reference.scatter_2d import scatter_2d_ref
    from tandem.kernels.triton.input_prep import prepare_inputs_triton
    from tandem.kernels.triton.scatter_2d import scatter_2d_triton

    g = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    rows = torch.randperm(32, generator=g)[:12].to(dev)
    lens = torch.randint(1, 600, (12,), generator=g).to(dev)
    starts = torch.randint(0, 300, (12,), generator=g).to(dev)
    cu = torch.cumsum(lens, 0) - lens
    total = int(lens.sum())
    tokens = torch.randint(0, 50_000, (32, 1024), generator=g).to(dev)
    table = torch.randint(1, 1 << 33, (32, 1024), generator=g).to(dev)
    a = prepare_inputs_ref(tokens, table, rows, starts, lens, cu, total)
    b = prepare_inputs_triton(tokens, table, rows, starts, lens, cu, total)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    r = rows.repeat_interleave(8)
    c = torch.arange(8, device=dev).repeat(12) + 100
    v = torch.randint(1, 1 << 20, (96,), generator=g).to(dev)
    t1, t2 = table.clone(), table.clone()
    scatter_2d_ref(t1, r, c, v)
    scatter_2d_triton(t2, r, c, v)
    assert torch.equal(t1, t2)
    s = torch.randint(0, 50_000, (12,), generator=g).to(dev)
    k1, k2 = tokens.clone(), tokens.clone()
    scatter_2d_ref(k1, rows, starts, s)
    scatter_2d_triton(k2, rows, starts, s)
    assert torch.equal(k1, k2)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_fp32_greedy_parity_with_transformers(arch: str, eager: bool, tiny_model, launch_client) -> None:
    model = tiny_model(arch)
    client = launch_client(model, device="cuda", dtype="float32", enforce_eager=eager)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 7, 33, 120, 300)]
    outs = client.generate_batch(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                                 progress=False)
    equal = sum(assert_greedy_parity(o.token_ids, greedy(model, p, 32), f"cuda {arch} len {len(p)}")
                for p, o in zip(prompts, outs))
    # as on CPU: near-ties are rare
    assert equal >= len(prompts) - 1, f"only {equal}/{len(prompts)} sequences equal"
    check_idle_engine(client)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_bf16_greedy_parity_with_transformers_bf16(eager: bool, tiny_model, launch_client) -> None:
    model = tiny_model("llama")
    client = launch_client(model, device="cuda", dtype="auto", enforce_eager=eager)  # auto is bf16 on CUDA
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 7, 33, 120, 300)]
    outs = client.generate_batch(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                                 progress=False)
    equal = sum(
        assert_greedy_parity(
            o.token_ids, greedy(model, p, 16, torch.bfloat16), f"cuda bf16 len {len(p)}", NEAR_TIE_BF16
        )
        for p, o in zip(prompts, outs)
    )
    assert equal >= len(prompts) - 2, f"only {equal}/{len(prompts)} sequences equal"  # as on CPU's bf16 test
    check_idle_engine(client)


# (seq_len, extend_len) per request; the same shapes as tests/kernels/test_paged_attention_triton.py (not
# imported:
# it turns the Triton interpreter on, and here the kernels must run natively).
ATTN_CASES = {
    "decodes": [(1, 1), (64, 1), (65, 1), (150, 1), (7, 1)],
    "mixed": [(30, 1), (25, 25), (140, 1), (60, 17), (9, 9), (82, 35), (2, 1)],
    "prefill-blocks": [(65, 65), (1, 1)],
}


@pytest.mark.parametrize("case", sorted(ATTN_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_paged_attention_equals_reference_on_cuda(case: str, dtype: torch.dtype) -> None:
    from tandem.kernels.reference.paged_attention import paged_attention_ref
    from tandem.kernels.triton.paged_attention import paged_attention_triton
    from tests.kernels.test_paged_attention import make_case

    c = make_case(ATTN_CASES[case], hkv=2, group=4, seed=1, d=64)
    c = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}
    for k in ("q", "k_pool", "v_pool"):
        c[k] = c[k].to(dtype)
    args = (c["q"], c["k_pool"], c["v_pool"], c["req_to_token"], c["req_pool_indices"], c["seq_lens"],
            c["extend_lens"], c["scale"])
    ext = c["extend_lens"]
    got = paged_attention_triton(*args, cu_lens=torch.cumsum(ext, 0) - ext, max_extend=int(ext.max()))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), paged_attention_ref(*args).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", ["decodes", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_q8_0_pools_on_cuda(case: str, dtype: torch.dtype) -> None:
    """--kv-cache-dtype q8_0 on the device: torch's quantizer there gives the CPU's bytes, and the Triton
    kernels over the blocks give the float32 reference's result on their values (the output in q's dtype).
    Their CPU twins (interpreted): tests/kernels/test_kv_q8_0.py."""
    from tandem.kernels.reference.kv_quant import dequantize_q8_0, quantize_q8_0
    from tandem.kernels.reference.paged_attention import paged_attention_ref
    from tandem.kernels.triton.paged_attention import paged_attention_triton
    from tests.kernels.test_paged_attention import make_case

    c = make_case(ATTN_CASES[case], hkv=2, group=4, seed=2, d=64)
    kq, vq = quantize_q8_0(c["k_pool"]), quantize_q8_0(c["v_pool"])
    assert torch.equal(quantize_q8_0(c["k_pool"].cuda()).cpu(), kq)
    rest = (c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["extend_lens"], c["scale"])
    want = paged_attention_ref(c["q"].to(dtype).float(), dequantize_q8_0(kq), dequantize_q8_0(vq), *rest)
    ext = c["extend_lens"].cuda()
    got = paged_attention_triton(c["q"].to(dtype).cuda(), kq.cuda(), vq.cuda(), *(t.cuda() for t in rest[:4]),
                                 c["scale"], cu_lens=torch.cumsum(ext, 0) - ext, max_extend=int(ext.max()))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("mapped", [False, True], ids=["shared-pool", "own-pool"])
@pytest.mark.parametrize("window", [3, 40])
def test_triton_sliding_window_attention_equals_dense_on_cuda(window: int, mapped: bool) -> None:
    """Its CPU twin (interpreted): tests/kernels/test_sliding_window_attention.py, whose cases these are
    (slots
    before each window poisoned; the sliding layers' own pool read through its slot map)."""
    from tandem.kernels.triton.paged_attention import paged_attention_triton
    from tests.kernels.test_sliding_window_attention import CASES, _split_pool, windowed_case

    c = windowed_case(CASES["mixed"], window, group=2, seed=window + mapped)
    k, v, slot_map = c["k_pool"], c["v_pool"], None
    if mapped:
        c["req_to_token"] = c["req_to_token"].clamp(min=0)
        k, v, slot_map = _split_pool(c, window, seed=window)
    ext = c["extend_lens"]
    cuda = {
        name: c[name].cuda() for name in ("q", "req_to_token", "req_pool_indices", "seq_lens", "extend_lens")
    }
    got = paged_attention_triton(
        cuda["q"],
        k.cuda(),
        v.cuda(),
        cuda["req_to_token"],
        cuda["req_pool_indices"],
        cuda["seq_lens"],
        cuda["extend_lens"],
        c["scale"],
        cu_lens=(torch.cumsum(ext, 0) - ext).cuda(),
        max_extend=int(ext.max()),
        window=window,
        slot_map=None if slot_map is None else slot_map.cuda(),
    )
    torch.testing.assert_close(got.cpu(), c["dense"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_gemma3_greedy_parity_with_transformers(eager: bool, tiny_model, launch_client) -> None:
    """Gemma 3 on CUDA (window 16, the sliding layers' own pool, decode graphs unless eager) against
    transformers; its CPU twin: tests/test_gemma3.py."""
    model = tiny_model("gemma3")
    client = launch_client(model, device="cuda", dtype="float32", enforce_eager=eager)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 15, 17, 90, 300)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = client.generate_batch(prompts, params, progress=False)
    assert_parity_floor([(o.token_ids, greedy(model, p, 32), f"cuda gemma3 len {len(p)}")
                         for p, o in zip(prompts, outs, strict=True)], max_detours=2)  # as its CPU twin
    assert client.stats().swa_kv_pool_size > 0
    check_idle_engine(client)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "e", "k"), [(1, 8, 2), (37, 8, 8), (300, 64, 4)])
def test_triton_moe_experts_equal_reference_on_cuda(t: int, e: int, k: int, dtype: torch.dtype) -> None:
    from tandem.kernels.reference.moe import experts_ref, route_ref
    from tandem.kernels.triton.moe import experts_triton

    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 256, generator=g).cuda().to(dtype)
    w13 = (torch.randn(e, 192, 256, generator=g) / 16).cuda().to(dtype)
    w2 = (torch.randn(e, 256, 96, generator=g) / 10).cuda().to(dtype)
    weights, ids = route_ref(torch.randn(t, e, generator=g).cuda(), k, True)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(experts_triton(x, w13, w2, weights, ids).float(),
                               experts_ref(x, w13, w2, weights, ids).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_moe_greedy_parity_with_transformers(eager: bool, tiny_model, launch_client) -> None:
    """A Qwen3-MoE model on CUDA (the Triton grouped experts, in decode graphs unless eager) against
    transformers; its CPU twin: tests/test_e2e_moe.py."""
    model = tiny_model("qwen3_moe")
    client = launch_client(model, device="cuda", enforce_eager=eager)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 7, 40, 150)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = client.generate_batch(prompts, params, progress=False)
    assert_parity_floor([(o.token_ids, greedy(model, p, 24), f"cuda qwen3_moe len {len(p)}")
                         for p, o in zip(prompts, outs, strict=True)], max_detours=1)  # as its CPU twin
    check_idle_engine(client)


def test_cuda_async_equals_sync(tiny_model, launch_client) -> None:
    model = tiny_model("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 200))] for _ in range(24)]
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(24)]
    res = {}
    for mode in (True, False):
        c = launch_client(model, device="cuda", dtype="float32", async_scheduling=mode)
        res[mode] = [o.token_ids for o in c.generate_batch(prompts, params, progress=False)]
        check_idle_engine(c)
    assert res[True] == res[False]


def test_host_kv_tier_copies_round_trip_on_cuda() -> None:
    """Pinned host pool, async DMA per run of host slots: device -> host -> other device slots keeps
    the KV bit for bit, and a step's to_host copies run before its loads."""
    from tandem.protocol.messages import KVCopies
    from tandem.worker.kv_cache import KVCache

    kv = KVCache(3, 256, 2, 8, torch.bfloat16, "cuda", max_reqs=4, max_context=64, host_slots=128)
    assert kv.host_k[0].is_pinned()
    for layer in kv.k + kv.v:
        layer.copy_(torch.randn_like(layer, dtype=torch.float32).to(torch.bfloat16))
    src = list(range(10, 40))
    want = [layer[src].clone() for layer in kv.k + kv.v]
    host = list(range(60, 70)) + list(range(5, 25))  # two runs
    kv.copy(KVCopies(to_host_src=src, to_host_dst=host))
    dst = list(range(100, 130))
    kv.copy(KVCopies(to_device_src=host, to_device_dst=dst))
    torch.cuda.synchronize()
    for w, layer in zip(want, kv.k + kv.v):
        assert torch.equal(layer[dst], w)
    # Evicting 100..129 to the host and loading other KV into them in one step: the save comes first.
    kv.copy(KVCopies(to_host_src=dst, to_host_dst=list(range(30, 60)), to_device_src=host[:5],
                     to_device_dst=dst[:5]))
    kv.copy(KVCopies(to_device_src=list(range(30, 60)), to_device_dst=list(range(140, 170))))
    torch.cuda.synchronize()
    for w, layer in zip(want, kv.k + kv.v):
        assert torch.equal(layer[140:170], w)


def test_host_kv_tier_on_cuda_matches_a_large_pool(tiny_model, launch_client) -> None:
    model = tiny_model("llama")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(120)] for _ in range(12)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    large = launch_client(model, device="cuda", kv_cache_tokens=8192)
    want = [c.token_ids for c in large.generate_batch(prompts, params, progress=False)]
    tiered = launch_client(
        model, device="cuda", kv_cache_tokens=256, host_kv_tokens=4096, max_running_requests=2
    )
    for _ in range(2):  # the second round finds the prompts in the host tier
        got = [c.token_ids for c in tiered.generate_batch(prompts, params, progress=False)]
        assert got == want
    assert tiered.stats().host_hit_tokens > 0
    check_idle_engine(tiered)


def _runner_and_scheduler(model, **opts):
    from tandem.protocol.engine_config import EngineConfig
    from tandem.protocol.model_info import read_model_info
    from tandem.scheduler.scheduler import Scheduler
    from tandem.worker.model_runner import ModelRunner

    cfg = EngineConfig(model=str(model), device="cuda", kv_cache_tokens=8192, max_running_requests=32, **opts)
    info = read_model_info(cfg.model)
    runner = ModelRunner(cfg, info)
    return runner, Scheduler(cfg, info, runner.num_kv_slots, num_swa_slots=runner.num_swa_slots)


def test_step_launch_never_waits_for_the_device(tiny_model) -> None:
    """A step's launch (new requests with every sampling feature but logprobs, input prep, attention or
    a decode graph's replay, penalties, sampling, write-back) queues work without one host-device sync."""
    from tandem.protocol.messages import TokenizedRequest

    runner, sched = _runner_and_scheduler(tiny_model("llama"), dtype="bfloat16")
    rng = random.Random(2)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.7, min_p=0.05, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                       frequency_penalty=0.3, min_tokens=4, ignore_eos=True),
    ]
    launched = 0
    for step in range(10):
        if step in (0, 3):  # new requests join a running batch too
            for i, p in enumerate(params):
                ids = [rng.randrange(3, 1000) for _ in range(rng.randrange(5, 120))]
                sched.add_request(TokenizedRequest(f"s{step}-{i}", ids, p))
        so = sched.schedule()
        if so is None:
            break
        if step >= 2:  # the first steps compile the kernels
            torch.cuda.set_sync_debug_mode("error")
            launched += 1
        try:
            pending = runner.launch(so)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sched.commit(pending.result())
        sched.take_outbox()
    assert launched >= 5
    assert runner.graphs is not None and runner.graphs.num_runs >= 3  # decode steps replayed graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lora_add_equals_reference_on_cuda(dtype: torch.dtype) -> None:
    from tandem.kernels.reference.lora import LoraRows, lora_add_ref
    from tandem.kernels.triton.lora import lora_add_triton
    from tests.kernels.test_lora_add import grouped

    g = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    for rows, k, n, r in ((1, 2048, 6144, 192), (37, 2048, 2048, 64), (300, 8192, 2048, 64)):
        x, y = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
        a, b = torch.randn(4, r, k, generator=g) / k**0.5, torch.randn(4, r, n, generator=g) / r**0.5
        slot_of = torch.randint(-1, 4, (rows,), generator=g)
        args = [t.to(dev, dtype) for t in (x, a, b)]
        want = lora_add_ref(y.to(dev, dtype), *args, grouped(slot_of.to(dev)), torch.tensor([0, n], device=dev))
        got = lora_add_triton(y.to(dev, dtype), *args, LoraRows(slot_of.to(dev)), torch.tensor([0, n], device=dev))
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_captured_decode_graphs_run_a_step_mixing_adapters_as_eager(tiny_model) -> None:
    """The captured twin of tests/kernels/test_lora_add.py's padded static batch: each target layer's LoRA
    launches replay over the graph's static slot buffer."""
    from tandem.kernels.ops import resolve_ops
    from tandem.worker.loader import load_model
    from tests.kernels.test_lora_add import replay_steps_as_eager

    dev = torch.device("cuda")
    ops = resolve_ops(dev, torch.float32)
    model = load_model(tiny_model("llama"), torch.float32, dev, ops=ops)
    replay_steps_as_eager(model, dev, capture=True, atol=1e-4)

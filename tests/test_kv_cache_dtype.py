"""--kv-cache-dtype: the option and its errors, K/V rounded when written as torch rounds, the worker's pools
(device and host tier) in that dtype and sized by its element. Kernels: tests/kernels/; greedy parity
through the whole engine: tests/test_e2e_parity.py."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.model_info import read_model_info
from tandem.worker.attention_backend import CpuPlan
from tandem.worker.kv_cache import KVCache
from tandem.worker.memory import kv_bytes_per_token
from tandem.worker.model_runner import ModelRunner


def test_a_bad_value_is_a_clear_error(tiny_model) -> None:
    why = "must be auto, float32, float16, bfloat16 or q8_0"
    for bad in ("fp8", "half", "AUTO"):
        with pytest.raises(ValueError, match=f"invalid engine option kv_cache_dtype='{bad}': {why}"):
            EngineConfig.from_options("m", kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="invalid engine option.*kv_cache_dtype"):
        EngineConfig.from_options("m", kv_cache_dtype=16)
    assert EngineConfig.from_options("m", kv_cache_dtype="float16").kv_cache_dtype == "float16"
    assert EngineConfig("m").kv_cache_dtype == "auto"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.launch.cli",
            "serve",
            "--model",
            str(tiny_model("llama")),
            "--kv-cache-dtype",
            "fp8",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2  # the flag's choices are the option's values (protocol/choices.py)
    assert "argument --kv-cache-dtype: invalid choice: 'fp8'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_write_rounds_to_nearest_even_as_torch_does(dtype: torch.dtype) -> None:
    h = 2.0 ** -(11 if dtype == torch.float16 else 8)  # half an ulp at 1 (11 or 8 significant bits)
    # (written, stored): a tie goes to the even neighbour, past a tie goes up, -0 and inf stay
    cases = [(1 + h, 1.0), (1 + 3 * h, 1 + 4 * h), (1 + 1.5 * h, 1 + 2 * h), (-(1 + h), -1.0), (-0.0, -0.0),
             (float("inf"), float("inf"))]
    if dtype == torch.float16:  # past the largest half (65504): 65519.99 rounds down, 65520 (a tie) up to inf
        cases += [(65519.99, 65504.0), (65520.0, float("inf")), (2.0**-25, 0.0), (3 * 2.0**-25, 2.0**-23)]
    kv = KVCache(1, 64, 1, len(cases), dtype, "cpu", max_reqs=1, max_context=4)
    written = torch.tensor([w for w, _ in cases], dtype=torch.float32).view(1, 1, -1)
    random = torch.randn(20, 1, len(cases)) * 100
    kv.write(0, torch.tensor([5]), written, -written)
    kv.write(0, torch.arange(30, 50), random, random * 3)
    assert kv.k[0].dtype == kv.v[0].dtype == dtype
    want = torch.tensor([s for _, s in cases], dtype=dtype)
    assert torch.equal(kv.k[0][5, 0].view(torch.int16), want.view(torch.int16))  # bits: -0 is not +0
    assert torch.equal(kv.v[0][5, 0].view(torch.int16), (-want).view(torch.int16))
    assert torch.equal(kv.k[0][30:50].view(torch.int16), random.to(dtype).view(torch.int16))
    assert torch.equal(kv.v[0][30:50].view(torch.int16), (random * 3).to(dtype).view(torch.int16))


def _runner(model, monkeypatch, available: int, **opts: object) -> ModelRunner:
    # A fixed amount of free RAM, so the pool's size depends on the KV element alone.
    monkeypatch.setattr(
        "tandem.worker.memory.psutil.virtual_memory", lambda: SimpleNamespace(available=available)
    )
    cfg = EngineConfig(model=str(model), device="cpu", dtype="float32", max_running_requests=8, **opts)
    return ModelRunner(cfg, read_model_info(cfg.model))


def test_the_worker_pools_are_in_the_kv_dtype_and_sized_by_its_element(tiny_model, monkeypatch) -> None:
    model = tiny_model("llama")
    sized = {"kv_memory_fraction": 0.1, "host_kv_memory_gb": 0.002}
    f32 = _runner(model, monkeypatch, 30 << 20, **sized)
    f16 = _runner(model, monkeypatch, 30 << 20, kv_cache_dtype="float16", **sized)
    assert f32.kv.k[0].dtype == f32.kv.host_k[0].dtype == torch.float32
    for pool in (f16.kv.k, f16.kv.v, f16.kv.host_k, f16.kv.host_v):
        assert all(t.dtype == torch.float16 for t in pool)
    mc = f16.model.config
    assert 2 * kv_bytes_per_token(mc, torch.float16) == kv_bytes_per_token(mc, torch.float32)
    per_token = kv_bytes_per_token(mc, torch.float16)
    assert f16.num_kv_slots == (30 << 20) // 10 // per_token == 2 * f32.num_kv_slots, "2-byte elements"
    assert f16.num_host_slots == 2 * 10**6 // per_token == 2 * f32.num_host_slots, "and so the host tier"
    assert f16.model.dtype == torch.float32 and f16.ops.native == f32.ops.native  # the model is untouched
    if f16.ops.native:  # the C kernels keep running, the attention one over the half pool
        batch = SimpleNamespace(req_pool_indices_cpu=[0], seq_lens_cpu=[3], extend_lens_cpu=[3], image_spans=None)
        assert isinstance(f16.model.attn_backend.plan(batch, f16.kv), CpuPlan)


def test_triton_with_another_kv_dtype_is_refused(tiny_model, monkeypatch) -> None:
    with pytest.raises(ValueError, match="kv-cache-dtype float16 with a torch.float32 model needs --att"):
        _runner(tiny_model("llama"), monkeypatch, 30 << 20, kv_cache_dtype="float16", kv_cache_tokens=64,
                attention_backend="triton")

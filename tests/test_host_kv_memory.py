"""--host-kv-memory-gb: the host tier sized in GB, its tokens derived from the model's KV bytes per token
at the KV dtype; exactly one of the two sizes (or neither); bad values are clear errors."""
from __future__ import annotations

import math

import pytest
import torch

from tandem.launch.cli_options import add_engine_flags, config_from_args
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.model_config import read_model_config
from tandem.worker.memory import host_pool_tokens, kv_bytes_per_token
from tests.conftest import check_idle_engine


def test_tokens_follow_the_kv_bytes_per_token_dtype_and_page(tiny_model) -> None:
    mc = read_model_config(tiny_model("llama"))
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4  # fp32
    assert kv_bytes_per_token(mc, torch.float32) == per_token
    cfg = EngineConfig(model="x", host_kv_memory_gb=0.01)
    assert host_pool_tokens(cfg, mc, torch.float32) == 10**7 // per_token
    assert host_pool_tokens(cfg, mc, torch.bfloat16) == 10**7 // (per_token // 2), (
        "half the bytes, twice the tokens"
    )
    paged = EngineConfig(model="x", host_kv_memory_gb=0.01, page_size=16)
    assert host_pool_tokens(paged, mc, torch.float32) == 10**7 // per_token // 16 * 16
    assert host_pool_tokens(EngineConfig(model="x", host_kv_tokens=640), mc, torch.float32) == 640
    assert host_pool_tokens(EngineConfig(model="x"), mc, torch.float32) == 0


def test_too_small_or_too_large_a_size_is_a_clear_error(tiny_model) -> None:
    mc = read_model_config(tiny_model("llama"))
    per_token = kv_bytes_per_token(mc, torch.float32)
    under_a_page = EngineConfig(model="x", host_kv_memory_gb=3 * per_token / 1e9, page_size=4)
    with pytest.raises(ValueError, match="holds no page of KV"):
        host_pool_tokens(under_a_page, mc, torch.float32)
    with pytest.raises(ValueError, match="more than the .* GB of RAM available"):
        host_pool_tokens(EngineConfig(model="x", host_kv_memory_gb=1e9), mc, torch.float32)


@pytest.mark.parametrize(
    "opts, why",
    [
        ({"host_kv_memory_gb": 1.0, "host_kv_tokens": 64}, "host_kv_tokens or host_kv_memory_gb"),
        ({"host_kv_memory_gb": -1.0}, "must be > 0"),
        ({"host_kv_memory_gb": 0.0}, "must be > 0"),
        ({"host_kv_memory_gb": math.nan}, "must be > 0"),
        ({"host_kv_memory_gb": 1.0, "prefix_cache": False}, "needs the prefix cache"),
    ],
)
def test_bad_memory_sizes_are_rejected(opts: dict, why: str) -> None:
    with pytest.raises(ValueError, match=f"host_kv_memory_gb.*{why}"):
        EngineConfig(model="x", **opts)


def test_either_size_turns_the_tier_on() -> None:
    assert not EngineConfig(model="x").host_tier
    assert EngineConfig(model="x", host_kv_tokens=64).host_tier
    assert EngineConfig(model="x", host_kv_memory_gb=0.5).host_tier


def test_the_flag_parses_and_both_flags_fail() -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    cfg = config_from_args(p.parse_args(["--model", "m", "--host-kv-memory-gb", "2.5"]))
    assert cfg.host_kv_memory_gb == 2.5 and cfg.host_kv_tokens == 0
    assert "GB" in p.format_help()
    with pytest.raises(ValueError, match="host_kv_memory_gb"):
        config_from_args(p.parse_args(["--model", "m", "--host-kv-memory-gb", "2", "--host-kv-tokens", "64"]))


def test_engine_sizes_its_host_pool_from_gb(tiny_model, launch_client) -> None:
    model = tiny_model("llama")
    per_token = kv_bytes_per_token(read_model_config(model), torch.float32)
    client = launch_client(model, kv_cache_tokens=128, host_kv_memory_gb=0.002, dtype="float32", page_size=4,
                           debug_integrity=True)
    want = 2 * 10**6 // per_token // 4 * 4
    st = client.stats()
    assert st.host_kv_pool_size == want
    # The tier is used: prompts 3x the device pool, the first resent after the others pushed it out.
    prompts = [[(7 * c + i) % 900 + 3 for i in range(100)] for c in range(3)]
    for p in prompts + prompts[:1]:
        client.generate(p, {"max_tokens": 2, "temperature": 0.0})
    st = client.stats()
    assert st.host_hit_tokens > 0 and 0 < st.host_kv_used <= want
    check_idle_engine(client)

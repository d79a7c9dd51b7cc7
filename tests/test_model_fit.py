"""A configuration the model cannot run is refused before any process starts: `tandem serve` prints one
line naming the field (no traceback, nothing spawned), `Client.launch` raises ConfigError in the caller."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tandem import Client
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.errors import ModelLoadError
from tandem.protocol.model_fit import ConfigError, check_model_fits


def _edited(src: Path, dst: Path, **fields: object) -> Path:
    """A copy of a model whose config.json has these fields changed (None: removed)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_each_field_the_model_cannot_run_is_named(tiny_model, tmp_path) -> None:
    llama = tiny_model("llama")  # 4 heads, 2 KV heads, intermediate 128, 2048 positions
    cases = [
        (
            _edited(llama, tmp_path / "h3", num_attention_heads=3, head_dim=16),
            {"tp_size": 2},
            "tp_size=2: the model's num_attention_heads=3 is not divisible by it",
        ),
        (
            _edited(llama, tmp_path / "kv3", num_attention_heads=6, num_key_value_heads=3, head_dim=16),
            {"tp_size": 2},
            "num_key_value_heads=3 neither divides it nor is divisible by it",
        ),
        (
            _edited(llama, tmp_path / "i130", intermediate_size=130),
            {"tp_size": 4},
            "intermediate_size=130 is not divisible by it",
        ),
        (llama, {"max_model_len": 4096}, "max_model_len 4096 exceeds the model's 2048"),
        (
            _edited(llama, tmp_path / "long", max_position_embeddings=1 << 30),
            {"kv_memory_fraction": 0.01},
            "kv_memory_fraction=0.01: ",
        ),
        (
            _edited(tiny_model("qwen3_moe"), tmp_path / "topk", num_experts_per_tok=99),
            {},
            "num_experts_per_tok=99: must be in [1, num_experts=",
        ),
        (
            _edited(tiny_model("qwen3_moe"), tmp_path / "only", mlp_only_layers=[7]),
            {},
            "mlp_only_layers: layer 7 is outside [0, 2)",
        ),
    ]
    for model, opts, message in cases:
        with pytest.raises(ConfigError) as e:
            check_model_fits(EngineConfig(model=str(model), device="cpu", **opts))
        assert message in str(e.value), (opts, str(e.value))
    # What fits passes: an explicit pool (the operator's choice, even below one request at max_model_len),
    # KV heads replicated over more ranks than they are.
    check_model_fits(EngineConfig(model=str(llama), kv_cache_tokens=1024, device="cpu"))
    check_model_fits(
        EngineConfig(model=str(llama), kv_cache_tokens=512, max_model_len=512, tp_size=4, device="cpu")
    )
    # A sliding-window field out of range is the model's own error, read before anything else.
    with pytest.raises(ModelLoadError, match="config field sliding_window: 0"):
        check_model_fits(
            EngineConfig(model=str(_edited(tiny_model("gemma3"), tmp_path / "w0", sliding_window=0)))
        )


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_serve_and_launch_refuse_before_spawning(tiny_model, tmp_path) -> None:
    model = _edited(tiny_model("llama"), tmp_path / "h3", num_attention_heads=3, head_dim=16)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.launch.cli",
            "serve",
            "--model",
            str(model),
            "--tp-size",
            "2",
            "--no-http",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "tandem: engine failed to start: tp_size=2: the model's num_attention_heads=3 is not divisible by it"]
    assert "tandem-worker" not in r.stdout  # no process was announced: none started
    before = _children()
    with pytest.raises(ConfigError, match="num_attention_heads=3"):
        Client.launch(str(model), tp_size=2)
    assert _children() == before  # raised in the caller: no engine process was spawned

"""Client.launch starts `tandem serve` with flags it writes itself (frontend imports nothing from launch):
they must parse back to the very config, or a launched engine would run with other options."""
from __future__ import annotations

from tandem.frontend.client.engine_process import config_to_argv
from tandem.launch.cli import _parser
from tandem.launch.cli_options import config_from_args
from tandem.protocol.engine_config import EngineConfig


def test_flags_parse_back_to_the_config() -> None:
    for cfg in (
        EngineConfig("m"),
        EngineConfig(
            "m",
            kv_cache_tokens=4096,
            prefix_cache=False,
            async_scheduling=False,
            enforce_eager=True,
            max_model_len=512,
            kv_memory_fraction=0.25,
            speculative_method="ngram",
            dist_init_addr="h:1",
            kv_cache_dtype="float16",
            cpu_int8_activations=True,
            scheduling_policy="priority",
            session_kv_tokens=128,
        ),
    ):
        assert config_from_args(_parser().parse_args(["serve", *config_to_argv(cfg)])) == cfg

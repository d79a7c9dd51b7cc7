"""HTTP server parts without a live engine: a dead engine is 503 in OpenAI's shape; the serve options."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx2 as httpx
import pytest

from tandem.protocol.serve_config import ServeConfig


def test_dead_engine_is_503(tiny_model) -> None:
    from transformers import AutoTokenizer

    from tandem.frontend.client.async_client import AsyncClient
    from tandem.frontend.http.app import create_app
    from tandem.frontend.http.metrics import Metrics
    from tandem.frontend.http.state import ServerState
    from tandem.protocol.model_info import read_model_info

    model = str(tiny_model("llama"))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        client = AsyncClient("ipc:///tmp/tandem-test-nobody-here", engine=gone)
        st = ServerState(client, AutoTokenizer.from_pretrained(model), read_model_info(model), model, "m",
                         Metrics("m"))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(st)), base_url="http://t"
        ) as h:
            health = await h.get("/health")
            comp = await h.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        await client.close()
        return health, comp

    health, comp = asyncio.run(scenario())
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
    assert comp.status_code == 503 and comp.json()["error"]["code"] == "engine_dead"


def test_serve_options() -> None:
    from tandem.launch.cli import _parser
    from tandem.launch.cli_options import config_from_args

    args = _parser().parse_args(["serve", "--model", "m", "--no-http", "--port", "9000", "--api-key", "k"])
    assert config_from_args(args, ServeConfig) == ServeConfig(http=False, port=9000, api_key="k")
    assert config_from_args(_parser().parse_args(["serve", "--model", "m"]), ServeConfig) == ServeConfig()
    assert ServeConfig().host == "127.0.0.1"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--model", "m", "--htttp-port", "1"])
    with pytest.raises(ValueError, match="port"):
        ServeConfig(port=70000)
    args = _parser().parse_args(
        ["serve", "--model", "m", "--reasoning-parser", "auto", "--response-store", "4"]
    )
    assert config_from_args(args, ServeConfig) == ServeConfig(reasoning_parser="auto", response_store=4)
    with pytest.raises(ValueError, match="reasoning_parser='qwen4'"):
        ServeConfig(reasoning_parser="qwen4")
    with pytest.raises(ValueError, match="response_store"):
        ServeConfig(response_store=-1)


def test_the_admin_key_is_its_own() -> None:
    from tandem.launch.cli import _parser
    from tandem.launch.cli_options import config_from_args

    args = _parser().parse_args(["serve", "--model", "m", "--api-key", "k", "--admin-api-key", "a"])
    assert config_from_args(args, ServeConfig) == ServeConfig(api_key="k", admin_api_key="a")
    with pytest.raises(ValueError, match="admin_api_key: must differ from api_key"):
        ServeConfig(api_key="k", admin_api_key="k")
    with pytest.raises(ValueError, match="admin_api_key=''"):
        ServeConfig(admin_api_key="")

"""Tensor parallelism on CPU (gloo): TP=2 gives transformers' greedy tokens through the whole stack, also for
a model with fewer KV heads than ranks; a dead rank stops the engine and waiting clients get an error."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

import pytest

from tandem import Client, SamplingParams
from tests.conftest import check_idle_engine
from tests.reference import assert_parity_floor, greedy
from tests.test_lifecycle import _serve, assert_killing_stops_engine


@pytest.mark.parametrize(
    "arch,kw",
    [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("qwen3", {"num_kv_heads": 1})],
    ids=["llama", "qwen2", "qwen3", "qwen3-1kv"],
)
def test_tp2_gives_transformers_greedy_tokens(arch: str, kw: dict, tiny_model, launch_client) -> None:
    model = tiny_model(arch, **kw)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 5, 17, 64, 150, 333)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tp2 = launch_client(model, tp_size=2)
    two = [o.token_ids for o in tp2.generate_batch(prompts, params, progress=False)]
    # TP=1 is held to transformers by test_e2e_parity: TP=2 is held to the same (cached) reference, not to
    # a TP=1 engine launched again for every case.
    runs = [(a, greedy(model, p, 24), f"{arch} TP=2 len {len(p)}") for p, a in zip(prompts, two, strict=True)]
    assert_parity_floor(runs, max_detours=1)
    check_idle_engine(tp2)


def test_killing_rank_1_stops_the_engine(tiny_model) -> None:
    assert_killing_stops_engine(tiny_model("llama"), "tandem-worker1", "--tp-size", "2")


def test_two_nodes_over_tcp_on_loopback(tiny_model) -> None:
    """--nnodes 2: node 1 runs only its worker rank; node 0 runs the rest; torch.distributed meets over
    TCP."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = str(tiny_model("llama"))
    common = [
        "--dtype",
        "float32",
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{port}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.launch.cli",
            "serve",
            "--model",
            model,
            "--kv-cache-tokens",
            "4096",
            *common,
            "--node-rank",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    node0: subprocess.Popen | None = None
    try:
        node0, endpoint, pids = _serve(model, *common, "--node-rank", "0")
        assert "tandem-worker1" not in pids and "tandem-scheduler" in pids  # rank 1 lives on node 1
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        with Client(endpoint) as c:
            two = c.generate([5, 6, 7, 8], params).token_ids
        assert_parity_floor([(two, greedy(model, [5, 6, 7, 8], 16), "TP=2 over two nodes")], max_detours=0)
        node0.terminate()
        assert node0.wait(20) == 0
        assert node1.wait(30) != 0  # its peer is gone: node 1 stops too
    finally:
        if node0 is not None and node0.poll() is None:  # a failed check above: node 0 still serves
            node0.terminate()
            node0.wait(30)
        if node1.poll() is None:
            node1.kill()


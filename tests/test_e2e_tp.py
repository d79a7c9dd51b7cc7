"""Tensor parallelism on CPU (gloo): TP=2 gives the TP=1 greedy tokens through the whole stack, also for
a model with fewer KV heads than ranks; a dead rank stops the engine and waiting clients get an error."""
from __future__ import annotations

import random
import threading
import time

import psutil
import pytest

from frontend import Client
from protocol import EngineDeadError, SamplingParams
from tests.conftest import check_idle_engine
from tests.test_e2e_scheduling import _assert_equal_or_near_tie
from tests.test_lifecycle import _children, _serve, _wait_gone


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("qwen3", {"num_kv_heads": 1})],
                         ids=["llama", "qwen2", "qwen3", "qwen3-1kv"])
def test_tp2_equals_tp1(arch: str, kw: dict, tiny_model, launch_client) -> None:
    model = tiny_model(arch, **kw)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 5, 17, 64, 150, 333)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    one = [o.token_ids for o in launch_client(model).generate_batch(prompts, params, progress=False)]
    tp2 = launch_client(model, tp_size=2)
    two = [o.token_ids for o in tp2.generate_batch(prompts, params, progress=False)]
    for p, a, b in zip(prompts, two, one):
        _assert_equal_or_near_tie(model, p, a, b)
    check_idle_engine(tp2)


def test_killing_rank_1_stops_the_engine(tiny_model) -> None:
    proc, endpoint, pids = _serve(tiny_model("llama"), "--tp-size", "2")
    kids = _children(proc.pid)
    client = Client(endpoint)
    errors: list[BaseException] = []
    started = threading.Event()

    def wait_on_request() -> None:
        try:
            for _ in client.stream([5, 6, 7], SamplingParams(max_tokens=1500, ignore_eos=True)):
                started.set()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)
        started.set()

    t = threading.Thread(target=wait_on_request)
    t.start()
    assert started.wait(30)
    t0 = time.monotonic()
    psutil.Process(pids["tandem-worker1"]).kill()
    t.join(20)
    assert not t.is_alive() and errors and isinstance(errors[0], EngineDeadError), errors
    assert time.monotonic() - t0 < 15
    assert proc.wait(20) != 0
    assert _wait_gone(kids) == []
    client.close()

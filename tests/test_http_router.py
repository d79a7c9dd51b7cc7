"""Replicas behind sglang-router: two `tandem serve` engines and the router on loopback."""
from __future__ import annotations

import random
import re
import socket
import string
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest

from tests.served import Served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finished(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        float(m.group(1)) for m in re.finditer(r"^tandem:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    )


@pytest.fixture(scope="module")
def replicas(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    engines = [Served(model, "--kv-cache-tokens", "4096", "--served-model-name", "tiny") for _ in range(2)]
    router = None
    try:
        for e in engines:
            e.ready()
        port = _free_port()
        log = tmp_path_factory.mktemp("router") / "router.log"
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *(e.url for e in engines),
             "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(_free_port()), "--log-level", "warn"],
            stdout=log.open("w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert router.poll() is None and time.monotonic() < deadline, (
                f"router did not come up:\n{log.read_text()}"
            )
            time.sleep(0.5)
        yield url, [e.url for e in engines]
    finally:
        if router is not None:
            router.terminate()
            router.wait(20)
        for e in engines:
            assert e.close() == 0


def _complete(url: str, prompt: str, max_tokens: int = 4) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_spread_and_prefixes_stick(replicas) -> None:
    router, workers = replicas
    rng = random.Random(0)
    words = ["alpha", "river", "stone", "cloud", "maple", "ember", "quartz", "delta", "orbit", "lumen"]
    before = [_finished(w) for w in workers]
    # Unrelated prompts, in flight together: no prefix is cached anywhere, so the router sends each to
    # the replica with the fewest requests in flight.
    prompts = ["".join(rng.choice(string.ascii_letters + " ") for _ in range(60)) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: _complete(router, p, 24), prompts))
    spread = [_finished(w) - b for w, b in zip(workers, before)]
    assert sum(spread) == 8 and min(spread) >= 1, spread

    system = "You are a careful assistant. " + " ".join(rng.choice(words) for _ in range(150))
    before = [_finished(w) for w in workers]
    outs = [_complete(router, f"{system}\nQuestion {i}: {rng.choice(words)}?") for i in range(6)]
    moved = [_finished(w) - b for w, b in zip(workers, before)]
    assert sorted(moved) == [0, 6], moved  # the shared prefix stays on one replica...
    # ...where it is cached
    assert all(o["usage"]["prompt_tokens_details"]["cached_tokens"] > 100 for o in outs[1:])

"""An overloaded engine answers 503 in OpenAI's error shape, streamed or not, and keeps serving after."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from tests.conftest import check_idle_engine
from tests.served import Served

NAME = "tiny"


@pytest.fixture(scope="module")
def served(tiny_model):
    s = Served(tiny_model("llama"), "--kv-cache-tokens", "8192", "--max-running-requests", "1",
               "--max-waiting-requests", "1", "--served-model-name", NAME).ready()
    yield s
    assert s.close() == 0


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_overload_is_503_then_serving_goes_on(served) -> None:
    from tandem import Client

    engine = Client(served.endpoint)
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
    long = {"model": NAME, "prompt": "Go on", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=long, timeout=60) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # held: a dropped iterator would close the stream
        next(lines)  # the one running slot is taken ...
        answers: list[httpx.Response] = []
        queued = threading.Thread(target=lambda: answers.append(httpx.post(
            served.url + "/v1/completions", timeout=60, json={**long, "stream": False, "max_tokens": 4})))
        queued.start()
        # ... and the one queue place
        _wait(lambda: engine.stats().waiting == 1, "the second request never queued")

        def one(i: int) -> openai.APIStatusError | None:
            try:
                if i % 2:
                    list(oai.completions.create(model=NAME, prompt=f"burst {i}", max_tokens=4, stream=True))
                else:
                    oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"b{i}"}],
                                                max_tokens=4)
            except openai.APIStatusError as e:
                return e
            return None

        with ThreadPoolExecutor(12) as pool:
            errors = list(pool.map(one, range(12)))
        assert engine.stats().running == 1  # the burst took nothing from the running request
    queued.join(60)  # the stream closed (its request aborted): the queued one ran
    assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 4
    for e in errors:  # every one of the burst, streamed (an HTTP status before any event) or not
        assert isinstance(e, openai.InternalServerError) and e.status_code == 503, e
        err = e.response.json()["error"]
        assert err["type"] == "service_unavailable" and err["code"] == "overloaded" and err["message"]
        assert err["param"] is None
    _wait(lambda: engine.stats().running == 0 and engine.stats().waiting == 0, "the engine never went idle")
    # ignore_eos: the default temperature samples, and the random model may end at any token
    after = oai.completions.create(model=NAME, prompt="after", max_tokens=3, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 3
    assert httpx.get(served.url + "/health").status_code == 200
    check_idle_engine(engine)
    engine.close()

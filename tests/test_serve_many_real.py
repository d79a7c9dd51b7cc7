"""Two real models behind one `tandem serve`, by the names `tandem pull` knows (SmolLM2-135M-Instruct and
Gemma 3 270M): each answers through the openai, anthropic and ollama clients (Gemma's base file has no chat
template: its chat routes give the typed error, its completions answer); 8 concurrent first requests
load a model once; --max-loaded-models 1 swaps them under interleaved traffic with no request lost or
failed; after --keep-alive idle a model's processes are gone and the server's memory is back, and the next
request loads it again."""
from __future__ import annotations

import re
import threading
import time
import urllib.request

import anthropic
import ollama
import openai
import psutil
import pytest

from tests.pulled_models import pulled_model
from tests.served import Served

pytestmark = pytest.mark.slow
NAMES = ("smollm2-135m-instruct", "gemma3-270m")


def _metric(url: str, name: str, model: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        page = r.read().decode()
    m = re.search(rf'^{re.escape(name)}\{{model_name="{re.escape(model)}"\}} (\S+)$', page, re.M)
    return float(m.group(1)) if m else 0.0


def _tree_rss(pid: int) -> tuple[int, list[psutil.Process]]:
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total, procs[1:]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    for name in NAMES:  # the models folder `tandem pull` fills, holding the pulled models
        (folder / name).symlink_to(pulled_model(name))
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_MODELS", str(folder))
    s = Served(NAMES[0], "--model", NAMES[1], "--keep-alive", "5s", "--max-loaded-models", "1",
               "--kv-cache-tokens", "4096", pin_dtype=False).ready()
    yield s
    s.close()
    mp.undo()


def test_two_real_models_by_name_through_three_clients(two) -> None:
    url = two.url
    base_rss, children = _tree_rss(two.proc.pid)
    assert not children  # nothing loaded before the first request
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]

    answers: list[str] = []
    errors: list[BaseException] = []

    def first() -> None:
        try:
            r = oa.chat.completions.create(model=NAMES[0], messages=msgs, max_tokens=12, temperature=0)
            answers.append(r.choices[0].message.content)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=first) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(answers) == 8 and len(set(answers)) == 1, (errors, answers)
    assert answers[0].strip()
    assert _metric(url, "tandem:model_loads", NAMES[0]) == 1  # 8 first requests, one load

    for name in NAMES:  # each by its name, through each client (`name:latest` as ollama's clients send)
        text = oa.completions.create(model=name, prompt="The capital of France is", max_tokens=6,
                                     temperature=0).choices[0].text
        assert text.strip()
        an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        oc = ollama.Client(host=url)
        if name == "gemma3-270m":  # the base model's file has no chat template: chat is a typed 400
            with pytest.raises(anthropic.BadRequestError, match="chat template"):
                an.messages.create(model=name, max_tokens=8, messages=msgs)
            with pytest.raises(ollama.ResponseError, match="chat template") as err:
                oc.chat(model=f"{name}:latest", messages=msgs, options={"num_predict": 8})
            assert err.value.status_code == 400
        else:
            reply = an.messages.create(model=name, max_tokens=8, messages=msgs)
            assert reply.content[0].text.strip() and reply.model == name
            assert oc.chat(model=f"{name}:latest", messages=msgs, options={"num_predict": 8}).message.content
        streamed = "".join(p.response for p in oc.generate(model=name, prompt="Hello", stream=True,
                                                            options={"num_predict": 8, "temperature": 0}))
        assert streamed == oc.generate(model=name, prompt="Hello",
                                       options={"num_predict": 8, "temperature": 0}).response


def test_one_loaded_at_a_time_swaps_with_nothing_lost_then_keep_alive_unloads(two) -> None:
    url = two.url
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    loads_before = {n: _metric(url, "tandem:model_loads", n) for n in NAMES}
    outcomes: list[str] = []

    def worker(i: int) -> None:
        for k in range(3):
            name = NAMES[(i + k) % 2]
            try:
                r = oa.completions.create(model=name, prompt=f"Count to {i + k}:", max_tokens=8, temperature=0)
                outcomes.append("ok" if r.choices[0].text is not None else "empty")
            except BaseException as e:
                outcomes.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes == ["ok"] * 24, outcomes  # every request answered, none failed, through the swaps
    swaps = sum(_metric(url, "tandem:model_loads", n) - loads_before[n] for n in NAMES)
    assert swaps >= 1
    assert sum(_metric(url, "tandem:model_loaded", n) for n in NAMES) == 1  # never two at once

    _, children = _tree_rss(two.proc.pid)
    assert children
    deadline = time.monotonic() + 30  # keep-alive 5 s, then the reaper (every second) and the drain
    while time.monotonic() < deadline and any(p.is_running() for p in children):  # a zombie runs: reaped too
        time.sleep(0.5)
    assert not [p for p in children if p.is_running()]
    assert sum(_metric(url, "tandem:model_loaded", n) for n in NAMES) == 0
    rss, left = _tree_rss(two.proc.pid)
    assert not left and rss < 400e6, rss  # the router alone: no model's memory left behind
    before = _metric(url, "tandem:model_loads", NAMES[1])
    oa.completions.create(model=NAMES[1], prompt="Hi", max_tokens=2)
    assert _metric(url, "tandem:model_loads", NAMES[1]) == before + 1  # loaded again

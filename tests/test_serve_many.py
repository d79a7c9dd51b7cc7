"""Several models behind one `tandem serve`, end to end: routed by `model` on every API, each started on its
first request (once, however many ask), the least recently used unloaded for another under
--max-loaded-models, a model that fails to load failing only its own requests, unknown models answered in
each API's own shape, and every child gone when the server stops."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from tests.served import Served

KEY = "sk-many"
ADMIN = "sk-operator"


def _call(url: str, path: str, body: object | None = None, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method="POST" if data is not None else "GET")
    req.add_header("content-type", "application/json")
    if key:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _states(url: str) -> dict[str, str]:
    status, body = _call(url, "/v1/models")
    assert status == 200, body
    return {m["id"]: m["state"] for m in body["data"]}


@pytest.fixture(scope="module")
def many(tiny_model, tmp_path_factory):
    a, b = tiny_model("llama"), tiny_model("qwen3")
    f = tmp_path_factory.mktemp("many") / "models.toml"
    f.write_text(f'[[model]]\nname = "b"\nmodel = "{b}"\n\n'
                 '[[model]]\nname = "broken"\nmodel = "/nonexistent/dir/model.gguf"\n')
    s = Served(a, "--served-model-name", "x", "--models-file", str(f), "--max-loaded-models", "1",
               "--api-key", KEY, "--kv-cache-tokens", "2048")
    # --served-model-name takes one model: refused with several
    assert s.proc.wait(60) != 0 and "take one model" in "".join(s.err)
    s = Served(a, "--models-file", str(f), "--max-loaded-models", "1", "--api-key", KEY,
               "--admin-api-key", ADMIN, "--kv-cache-tokens", "2048").ready()
    yield s
    s.close()


@pytest.mark.slow  # ~9 s: the fast tier (`make test`) keeps under its 10 minutes
def test_routes_by_model_loads_once_evicts_and_isolates_failures(many) -> None:
    url, name_a = many.url, "llama-tiny"  # the directory's own name
    assert _states(url) == {name_a: "unloaded", "b": "unloaded", "broken": "unloaded"}
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)

    def ask(model: str, stream: bool = False) -> str:
        msgs = [{"role": "user", "content": "Say something"}]
        if stream:
            parts = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                                   stream=True)
            return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        return client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                              temperature=0).choices[0].message.content

    texts: list[str] = []
    threads = [threading.Thread(target=lambda: texts.append(ask(name_a))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(texts) == 4 and len(set(texts)) == 1  # greedy: one answer
    assert ask(name_a, stream=True) == texts[0]  # streamed through the router, chunk by chunk
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        page = r.read().decode()
    assert f'tandem:model_loads{{model_name="{name_a}"}} 1.0' in page  # 4 first requests, one load
    assert f'tandem:request_success_total{{finished_reason="length",model_name="{name_a}"}} 5.0' in page
    assert _states(url)[name_a] == "loaded"

    text_b = ask("b")  # the limit is one model: a (idle) goes
    assert text_b != texts[0]  # another model answered
    assert _states(url) == {name_a: "unloaded", "b": "loaded", "broken": "unloaded"}

    with pytest.raises(openai.InternalServerError, match="failed to load"):
        ask("broken")
    states = _states(url)
    assert states["broken"] == "failed" and states["b"] == "loaded"  # b was not unloaded for a failed load
    _, listing = _call(url, "/v1/models")
    assert "nonexistent" in next(m for m in listing["data"] if m["id"] == "broken")["error"]
    assert ask("b:latest") == text_b  # ollama's tag is the same model

    assert ask(name_a) == texts[0]  # loaded again, the same answer
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert f'tandem:model_loads{{model_name="{name_a}"}} 2.0' in r.read().decode()


def test_unknown_models_bad_bodies_and_keys_in_each_apis_shape(many) -> None:
    url = many.url
    status, body = _call(url, "/v1/chat/completions", {"model": "zzz", "messages": []})
    assert status == 404 and body["error"]["code"] == "model_not_found" and "zzz" in body["error"]["message"]
    status, body = _call(url, "/v1/messages", {"model": "zzz", "max_tokens": 4, "messages": []})
    assert status == 404 and body["type"] == "error" and body["error"]["type"] == "not_found_error"
    status, body = _call(url, "/api/chat", {"model": "zzz", "messages": []})
    assert (status, body) == (404, {"error": "model 'zzz' not found"})
    status, body = _call(url, "/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = _call(url, "/v1/chat/completions", {"messages": []})  # several models: name one
    assert status == 400 and body["error"]["param"] == "model"
    status, body = _call(url, "/v1/chat/completions", {"model": "b", "messages": [], "keep_alive": "soon"})
    assert status == 400 and "keep_alive" in body["error"]["message"]
    status, body = _call(url, "/v1/models", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert _call(url, "/health", key=None)[0] == 200


@pytest.mark.slow  # ~10 s: the fast tier (`make test`) keeps under its 10 minutes
def test_ps_chat_page_keep_alive_zero_and_a_drain_stops_the_server_and_its_children(many, capsys) -> None:
    url = many.url
    status, body = _call(url, "/v1/completions", {"model": "b", "prompt": "hi", "max_tokens": 2})
    assert status == 200, body
    assert _states(url)["b"] == "loaded"
    import ollama

    oc = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"})
    assert {m.model for m in oc.list().models} == {"llama-tiny:latest", "b:latest", "broken:latest"}
    assert [m.model for m in oc.ps().models] == ["b:latest"]
    shown = oc.show("llama-tiny")  # answered without loading it (tools ask for every model listed)
    assert shown.modelinfo["general.architecture"] and _states(url)["llama-tiny"] == "unloaded"
    whole = oc.chat(model="b", messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 6,
                                                                                      "temperature": 0})
    parts = oc.chat(model="b:latest", messages=[{"role": "user", "content": "Hi"}], stream=True,
                    options={"num_predict": 6, "temperature": 0})
    assert "".join(p.message.content for p in parts) == whole.message.content and whole.done
    with pytest.raises(ollama.ResponseError) as err:
        oc.generate(model="zzz", prompt="x")
    assert err.value.status_code == 404 and "zzz" in err.value.error
    from tandem.launch.ps import main as ps

    ps(["--host", url, "--api-key", KEY])
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].split() == ["NAME", "SIZE", "CONTEXT", "UNTIL"] and shown[1].startswith("b:latest")
    assert "minutes from now" in shown[1]  # --keep-alive's default 5m
    with urllib.request.urlopen(url + "/", timeout=30) as r:  # the chat page, no key needed
        assert r.headers["content-type"].startswith("text/html") and b"/v1/chat/completions" in r.read()
    status, body = _call(url, "/api/generate", {"model": "b", "keep_alive": 0})
    assert status == 200 and body["done"] and body["done_reason"] == "unload"
    assert _states(url)["b"] == "unloaded"
    # any route takes it: keep_alive 0 on OpenAI's unloads b once its request ends
    status, body = _call(url, "/v1/completions", {"model": "b", "prompt": "hi", "max_tokens": 2,
                                                  "keep_alive": "0s"})
    assert status == 200, body
    deadline = time.monotonic() + 10
    while _states(url)["b"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _states(url)["b"] == "unloaded"
    status, _ = _call(url, "/v1/completions", {"model": "b", "prompt": "hi", "max_tokens": 2, "keep_alive": "5m"})
    assert status == 200
    children = psutil.Process(many.proc.pid).children(recursive=True)
    assert children  # b's engine
    assert _call(url, "/drain", {})[0] == 401  # the inference key is not the operator's
    status, body = _call(url, "/drain", {}, key=ADMIN)
    assert status == 202 and body["status"] == "draining"
    assert many.proc.wait(60) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"outlived the server: {alive}"


def test_a_child_gets_the_routers_key_even_when_it_begins_with_a_dash() -> None:
    # secrets.token_urlsafe may begin with "-": passed as a separate argument argparse took it for a flag
    from tandem.launch.cli import _parser
    from tandem.launch.cli_options import config_from_args
    from tandem.launch.serve_models import child_serve_argv
    from tandem.protocol.serve_config import ServeConfig

    scfg = ServeConfig(allowed_media_domains=["a.example"], limit_mm_per_prompt=3)
    args = _parser().parse_args(["serve", "--model", "m", *child_serve_argv(scfg, "m", "-dash-key")])
    child = config_from_args(args, ServeConfig)
    assert child.api_key == "-dash-key" and child.served_model_name == "m"
    assert child.allowed_media_domains == ["a.example"] and child.limit_mm_per_prompt == 3

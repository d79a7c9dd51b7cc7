"""LoRA adapters over HTTP, as vLLM serves them: `tandem serve --lora-modules a=DIR b=DIR`, a request names
an adapter by its `model` (the official `openai` and `anthropic` clients), `/v1/models` lists each adapter
with the base as its parent, and a name served by neither is the API's own 404; vLLM's load and unload
routes, behind the operator's key, each fault typed."""
from __future__ import annotations

import anthropic
import openai
import pytest

from tandem import Client
from tests.served import Served
from tests.test_lora import _adapter

NAME = "base-model"
ADMIN = "operator-key"
MSGS = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    base = tiny_model("llama")
    d = tmp_path_factory.mktemp("http-lora")
    a = _adapter(base, d / "a", 1, 8, ["q_proj", "v_proj", "down_proj"])
    b = _adapter(base, d / "b", 2, 4, ["o_proj", "gate_proj"])
    s = Served(base, "--lora-modules", f"alpha={a}", f"beta={b}", "--served-model-name", NAME,
               "--admin-api-key", ADMIN).ready()
    s.paths = {"alpha": str(a), "beta": str(b)}
    s.extra = _adapter(base, d / "gamma", 3, 8, ["k_proj", "up_proj"])
    yield s
    assert s.close() == 0


def test_openai_and_anthropic_name_an_adapter_by_model(served) -> None:
    with Client(served.endpoint) as c:
        want = {n: c.generate(MSGS, {"max_tokens": 8, "temperature": 0}, lora=n).text
                for n in (None, "alpha", "beta")}
    assert len(set(want.values())) == 3  # each adapter says something else
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
    models = {m.id: m for m in oai.models.list().data}
    assert set(models) == {NAME, "alpha", "beta"}
    assert models["alpha"].parent == NAME and models[NAME].parent is None  # type: ignore[attr-defined]
    assert models["beta"].root == served.paths["beta"]  # type: ignore[attr-defined]
    for name, model in ((None, NAME), ("alpha", "alpha"), ("beta", "beta")):
        r = oai.chat.completions.create(model=model, messages=MSGS, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want[name], model
    ant = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=60)
    m = ant.messages.create(model="beta", max_tokens=8, messages=MSGS, extra_body={"temperature": 0})
    assert m.content[0].text == want["beta"]
    with pytest.raises(openai.NotFoundError, match="`alpha`, `beta`"):
        oai.chat.completions.create(model="gamma", messages=MSGS, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):
        oai.embeddings.create(model="alpha", input="hi")
    r = oai.chat.completions.create(model="alpha", messages=MSGS, max_tokens=2)  # still serving
    assert r.choices[0].message.content is not None


def test_the_load_and_unload_routes_round_trip_behind_the_operators_key(served) -> None:
    import httpx

    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    load = {"lora_name": "gamma", "lora_path": str(served.extra)}
    with httpx.Client(base_url=served.url, timeout=60) as h:
        assert h.post("/v1/load_lora_adapter", json=load).status_code == 401  # not on the inference API
        r = h.post("/v1/load_lora_adapter", json=load, headers=admin)
        assert r.status_code == 200 and r.json()["generation"] == 1
        assert "gamma" in {m.id for m in oai.models.list().data}
        reply = oai.chat.completions.create(model="gamma", messages=MSGS, max_tokens=4, temperature=0)
        with Client(served.endpoint) as c:
            want = c.generate(MSGS, {"max_tokens": 4, "temperature": 0}, lora="gamma").text
        assert reply.choices[0].message.content == want
        faults = [
            ("/v1/load_lora_adapter", load, 409, "lora_conflict"),
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "invalid_request.lora"),
            ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, None),
            ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "model_not_found"),
        ]
        for route, body, status, code in faults:
            r = h.post(route, json=body, headers=admin)
            assert r.status_code == status, (route, body, r.text)
            if code is not None:
                assert r.json()["error"]["code"].endswith(code), r.text
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}, headers=admin)
        assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gamma", messages=MSGS, max_tokens=2)
    assert {m.id for m in oai.models.list().data} == {NAME, "alpha", "beta"}

"""POST /v1/embeddings through the official `openai` client against `tandem serve`: the engine's vectors as
floats and base64, every input shape, usage, and bad input in OpenAI's error shape while the server serves
on."""

from __future__ import annotations

import base64
import struct

import httpx2 as httpx
import openai
import pytest

from tests.conftest import check_idle_engine
from tests.served import Served

NAME = "tiny-embed"


@pytest.fixture(scope="module")
def served(tiny_model):
    s = Served(
        tiny_model("qwen3"),
        "--kv-cache-tokens",
        "4096",
        "--max-model-len",
        "128",
        "--pooling",
        "mean",
        "--served-model-name",
        NAME,
    ).ready()
    yield s
    assert s.close() == 0


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(served):
    from tandem import Client

    c = Client(served.endpoint)
    yield c
    c.close()


def _floats(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def test_float_and_base64_are_the_engines_vectors(oai, engine) -> None:
    texts = ["The river runs to the sea.", "你好，世界 🌍"]
    ref = engine.embed_batch(texts)
    r = oai.embeddings.create(model=NAME, input=texts, encoding_format="float")
    assert r.object == "list" and r.model == NAME and [d.index for d in r.data] == [0, 1]
    assert [d.embedding for d in r.data] == [e.embedding for e in ref]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(e.prompt_tokens for e in ref)
    raw = httpx.post(oai.base_url.join("embeddings"), json={"model": NAME, "input": texts,
                                                            "encoding_format": "base64"}).json()
    assert [_floats(d["embedding"]) for d in raw["data"]] == [e.embedding for e in ref]
    # The openai client asks for base64 and decodes it when no format is given.
    r2 = oai.embeddings.create(model=NAME, input=texts[0])
    assert r2.data[0].embedding == pytest.approx(ref[0].embedding, abs=0)


def test_token_id_inputs_and_extras(oai, engine) -> None:
    ids = [[5, 6, 7, 8], [9, 10]]
    r = oai.embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert [d.embedding for d in r.data] == [e.embedding for e in engine.embed_batch(ids)]
    one = oai.embeddings.create(model=NAME, input=ids[0], encoding_format="float")
    assert one.data[0].embedding == r.data[0].embedding and one.usage.prompt_tokens == 4
    raw = oai.embeddings.create(
        model=NAME, input="abc", encoding_format="float", extra_body={"normalize": False}
    )
    assert raw.data[0].embedding == engine.embed("abc", normalize=False).embedding
    # the full size
    full = oai.embeddings.create(model=NAME, input="abc", encoding_format="float", dimensions=64)
    assert len(full.data[0].embedding) == 64
    urgent = oai.embeddings.create(
        model=NAME, input="abc", encoding_format="float", extra_body={"priority": -3}
    )
    assert urgent.data[0].embedding == full.data[0].embedding


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [1] * 129}, "input"),  # past --max-model-len
    ({"input": [[1, 2], [5000]]}, "input"),  # outside the vocabulary
    ({"input": "abc", "dimensions": 16}, "dimensions"),  # not a Matryoshka model
    ({"input": "abc", "dimensions": 0}, "dimensions"),
    ({"input": "abc", "encoding_format": "int8"}, "encoding_format"),
    ({"input": {"text": "abc"}}, "input"),
    ({"input": "abc", "unknown_field": 1}, "unknown_field"),
])
def test_bad_input_gets_openais_error_shape(served, engine, body: dict, param: str) -> None:
    r = httpx.post(served.url + "/v1/embeddings", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"].startswith(param)
    ok = httpx.post(served.url + "/v1/embeddings", json={"model": NAME, "input": "still serving"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64
    check_idle_engine(engine)


def test_unknown_model_is_a_404(oai) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="nope", input="abc")

"""Images over HTTP to a served vision model, through the official `openai` and `anthropic` clients and
ollama's routes: a base64 image gets the answer the Python client gets for the same conversation; every bad
image (not an image, cut short, too large, too many, a URL the server may not fetch, an image to a text
model) is a typed 400 in each API's own shape, and the engine serves on."""
from __future__ import annotations

import base64
import io

import anthropic
import httpx2 as httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tandem import Client
from tests.conftest import check_idle_engine
from tests.served import Served

NAME = "tiny-vision"


def png(seed: int, w: int = 40, h: int = 30) -> bytes:
    im = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    (media / "a.png").write_bytes(png(5))
    s = Served(tiny_model("gemma3_vision"), "--served-model-name", NAME, "--limit-mm-per-prompt", "2",
               "--max-image-pixels", "1000000", "--allowed-local-media-path", str(media)).ready()
    s.media = media
    yield s
    assert s.close() == 0


@pytest.fixture(scope="module")
def engine(served, tiny_model):
    c = Client(served.endpoint, model=str(tiny_model("gemma3_vision")))
    yield c
    c.close()


SP = {"max_tokens": 8, "temperature": 0}


def _expected(engine: Client, raw: bytes, text: str = "What is it?") -> str:
    msgs = [{"role": "user", "content": [{"type": "image", "image": raw}, {"type": "text", "text": text}]}]
    return engine.generate(msgs, SP).text


def test_openai_anthropic_and_ollama_send_an_image_and_get_the_engines_answer(served, engine) -> None:
    raw = png(1)
    want = _expected(engine, raw)
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = oai.chat.completions.create(model=NAME, max_tokens=8, temperature=0,
                                    messages=[{"role": "user", "content": [
                                        {"type": "image_url", "image_url": {"url": data_url(raw)}},
                                        {"type": "text", "text": "What is it?"}]}])
    assert r.choices[0].message.content == want
    ant = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=60)
    m = ant.messages.create(model=NAME, max_tokens=8, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": [
                                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                             "data": base64.b64encode(raw).decode()}},
                                {"type": "text", "text": "What is it?"}]}])
    assert m.content[0].text == want
    resp = oai.responses.create(model=NAME, max_output_tokens=8, temperature=0,
                                input=[{"role": "user", "content": [
                                    {"type": "input_image", "image_url": data_url(raw)},
                                    {"type": "input_text", "text": "What is it?"}]}])
    assert resp.output_text == want
    o = httpx.post(served.url + "/api/chat", timeout=60, json={
        "model": NAME, "stream": False, "options": {"temperature": 0, "num_predict": 8},
        "messages": [{"role": "user", "content": "What is it?", "images": [base64.b64encode(raw).decode()]}]})
    assert o.status_code == 200
    assert "vision" in httpx.post(served.url + "/api/show", json={"model": NAME}).json()["capabilities"]
    local = oai.chat.completions.create(model=NAME, max_tokens=8, temperature=0,
                                        messages=[{"role": "user", "content": [
                                            {"type": "image_url", "image_url": {"url": str(served.media / "a.png")}},
                                            {"type": "text", "text": "What is it?"}]}])
    assert local.choices[0].message.content == _expected(engine, png(5))
    check_idle_engine(engine)


def test_every_bad_image_is_a_typed_400_and_the_engine_serves_on(served, engine) -> None:
    raw = png(2)
    cut = raw[: len(raw) // 2]
    big = png(3, 1200, 1000)  # 1.2 M pixels > --max-image-pixels 1 M
    oai = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def chat(*urls: str) -> openai.BadRequestError:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=NAME, max_tokens=2, messages=[
                {"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}])
        return e.value

    for urls, words in (
        ((data_url(b"not an image at all"),), "not an image"),
        ((data_url(cut),), "cannot be decoded"),
        ((data_url(big),), "pixels"),
        ((data_url(raw),) * 3, "--limit-mm-per-prompt"),
        (("https://example.com/cat.png",), "--allowed-media-domains"),
        (("/etc/passwd",), "outside the allowed directory"),
        (("data:image/png;base64,@@@",), "base64"),
        (("ftp://x/y.png",), "scheme"),
    ):
        err = chat(*urls)
        assert words in err.message, (words, err.message)
        assert err.body["code"] == "invalid_image" if isinstance(err.body, dict) else True
    ant = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}},
            {"type": "text", "text": "hi"}]}])
    assert e.value.body["type"] == "error" and "not an image" in e.value.message
    o = httpx.post(served.url + "/api/generate", timeout=60, json={"model": NAME, "prompt": "x", "images": ["aGk="]})
    assert o.status_code == 400 and "not an image" in o.json()["error"]
    assert _expected(engine, raw)  # still serving
    check_idle_engine(engine)


def test_an_image_to_a_text_model_is_a_typed_error(tiny_model) -> None:
    s = Served(tiny_model("llama"), "--served-model-name", "text").ready()
    try:
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="text", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(png(1))}}]}])
        assert "text only" in e.value.message
        r = oai.chat.completions.create(model="text", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content is not None
    finally:
        assert s.close() == 0

"""What the API fuzzer found on the old tree, each held here on scripted replies (no engine): the OpenAPI
document lists the answers the routes really give, bounds the server enforces are in the schemas, a value
of the wrong type is refused, an oversized session capacity is a 400 (it was a plain-text 500), a 405
names its methods."""
from __future__ import annotations

import asyncio

import pytest

from tandem import AsyncClient, InvalidRequestError
from tandem.protocol.errors import ErrorCode
from tandem.protocol.messages import MAX_SESSION_TIMEOUT_S
from tests.scripted_engine import KEY, NAME, scripted_app, transport

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def app(tiny_model):
    return scripted_app(tiny_model("llama"), None)[1]


def _call(app, method: str, path: str, body: dict | None = None):
    async def go():
        async with transport(app) as http:
            return await http.request(method, path, json=body, headers=AUTH)

    return asyncio.run(go())


def test_the_document_lists_every_answer(app) -> None:
    doc = _call(app, "GET", "/openapi.json").json()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert "422" not in codes, (method, path)  # validation errors are 400s here
            if "requestBody" in op:
                assert {"400", "413"} <= codes, (method, path)
                err = op["responses"]["400"]["content"]["application/json"]["schema"]
                assert "error" in err["properties"], (method, path)
    assert "/drain" not in doc["paths"]  # the scripted server has no admin key
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "401", "404", "503"} <= set(chat) and "text/event-stream" in chat["200"]["content"]
    anthropic = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert anthropic["properties"]["type"] == {"const": "error"}
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == [NAME]
    timeout = schemas["OpenSessionRequest"]["properties"]["timeout"]["anyOf"][0]
    assert timeout["maximum"] == MAX_SESSION_TIMEOUT_S
    assert schemas["CompletionRequest"]["additionalProperties"] == {"type": "null"}
    assert schemas["CompletionRequest"]["properties"]["no_stop_trim"] == {"const": False}


def test_values_the_schema_forbids_are_400s_in_the_apis_shape(app) -> None:
    cases = [
        ("/detokenize", {"tokens": ["0"]}, "tokens"),  # a string where an integer goes (it was decoded: 200)
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/open_session", {"capacity_tokens": 2**70}, "capacity_tokens"),  # was a plain-text 500 (OverflowError)
        ("/open_session", {"capacity_tokens": 16, "timeout": MAX_SESSION_TIMEOUT_S + 1}, "timeout"),
        ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "2"}, "max_tokens"),
        ("/v1/completions", {"model": NAME, "prompt": "x", "stop": [""]}, "stop"),
        ("/v1/completions", {"model": NAME, "prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"model": NAME, "prompt": "x", "unknown": 1}, "unknown"),
    ]
    for path, body, field in cases:
        r = _call(app, "POST", path, body)
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and field in (err["param"] or ""), (body, err)
    ok = _call(app, "POST", "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2, "unknown": None})
    assert ok.status_code == 200, ok.text  # a null extra asks for nothing, as the document says


def test_a_405_names_the_methods_it_takes(app) -> None:
    r = _call(app, "GET", "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


def test_the_client_refuses_a_capacity_it_cannot_send(tmp_path) -> None:
    async def main() -> None:
        client = AsyncClient(f"ipc://{tmp_path}/nobody")
        try:
            for bad in (2**70, 0, True, 1.5):
                with pytest.raises(InvalidRequestError) as e:
                    await client.open_session(bad)  # type: ignore[arg-type]
                assert e.value.code == ErrorCode.SESSION and "capacity_tokens" in e.value.message
        finally:
            await client.close()

    asyncio.run(main())

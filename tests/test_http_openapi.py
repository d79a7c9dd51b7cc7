"""What the API fuzzer found on the old tree, each held here on scripted replies (no engine): the OpenAPI
document lists the answers the routes really give, bounds the server enforces are in the schemas, a value
of the wrong type is refused, an oversized session capacity is a 400 (it was a plain-text 500), a 405
names its methods."""
from __future__ import annotations

import asyncio

import pytest

from tandem import AsyncClient, InvalidRequestError
from tandem.protocol.errors import ErrorCode
from tandem.protocol.session_messages import MAX_SESSION_TIMEOUT_S
from tests.scripted_engine import KEY, NAME, Reply, scripted_app, transport

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
    # A stream is documented by one event's schema (the fuzzer checks each event against it): `data` a string.
    event = chat["200"]["content"]["text/event-stream"]["schema"]
    assert event["required"] == ["data"] and event["properties"]["data"]["type"] == "string"
    anthropic = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"][
        "schema"
    ]
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
        # was a plain-text 500 (OverflowError)
        ("/open_session", {"capacity_tokens": 2**70}, "capacity_tokens"),
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
    ok = _call(
        app, "POST", "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2, "unknown": None}
    )
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


def test_an_empty_prompt_with_echo_and_logprobs_is_a_400(app) -> None:
    # The fuzzer's 500 (IndexError): echo's logprobs read the first token of a prompt that had none.
    for prompt in ("", [], [[]], [[1], []]):
        r = _call(
            app, "POST", "/v1/completions", {"model": NAME, "prompt": prompt, "echo": True, "logprobs": 1}
        )
        assert r.status_code == 400, (prompt, r.text)
        assert r.json()["error"]["code"] == ErrorCode.EMPTY_PROMPT, (prompt, r.text)


def test_token_ids_past_the_vocabulary_are_refused_and_documented(app) -> None:
    # The fuzzer's hang: a prompt id past 64 bits could not be encoded for the engine, the choice's task died
    # and the response waited forever. The schema bounds ids; the document says the model's own bound.
    doc = _call(app, "GET", "/openapi.json").json()
    ids = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert ids["minimum"] == 0 and ids["maximum"] == 1023 and "x-token-id" not in ids
    for body in (
        {"model": NAME, "prompt": [2**70, 0]},
        {"model": NAME, "prompt": "x", "stop_token_ids": [2**70]},
        {"model": NAME, "input": [2**70]},
    ):
        path = "/v1/embeddings" if "input" in body else "/v1/completions"
        r = _call(app, "POST", path, body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)


def test_the_client_refuses_what_the_wire_cannot_carry(tmp_path) -> None:
    async def main() -> None:
        client = AsyncClient(f"ipc://{tmp_path}/nobody")  # refused before anything is sent: no engine needed
        try:
            with pytest.raises(InvalidRequestError, match="cannot be encoded"):
                await client.generate([2**70, 0], {"max_tokens": 2})
            with pytest.raises(InvalidRequestError, match="cannot be encoded") as e:
                await client.generate([1], {"stop_token_ids": [2**70]})
            assert e.value.code == ErrorCode.PARAMS
        finally:
            await client.close()

    asyncio.run(main())


def test_a_fault_of_ours_ends_the_response_with_a_typed_500(tiny_model) -> None:
    # Any exception a choice's stream raises ends the response (before: only the engine's typed errors did,
    # and any other left it waiting forever); the body keeps the API's shape, streamed or not.
    engine, app = scripted_app(tiny_model("llama"), None)
    engine.script(Reply([], error=RuntimeError("boom")))
    r = _call(app, "POST", "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["code"] == ErrorCode.FAILED_INTERNAL, r.text
    assert "boom" in r.json()["error"]["message"]
    engine.script(["a", "b"])  # and the door serves on
    r = _call(app, "POST", "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab", r.text

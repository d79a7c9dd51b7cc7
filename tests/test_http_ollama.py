"""ollama's native API (/api/chat, /api/generate, /api/embed, /api/show, /api/tags, /api/ps, /api/version)
through the official `ollama` client: on scripted replies (what a random model cannot write: thinking,
tool calls, a chosen reply), the requests the engine got (prompt, sampling parameters, grammar), errors
in ollama's {"error": ...} shape with the client's ResponseError; and once against a served tiny model,
greedy text equal to the OpenAI routes' for the same prompt, whole and streamed."""
from __future__ import annotations

import asyncio
import contextlib
import json
import struct

import httpx
import ollama
import pytest

from tandem.frontend.completion import CompletionDelta
from tandem.frontend.embedding import Embedding
from tandem.frontend.http.chat_prompt import TEXT_ONLY
from tandem.frontend.http.ollama import ollama_chat_messages
from tandem.frontend.http.ollama_models import human_number, ollama_model_entry
from tandem.frontend.http.ollama_schema import OllamaMessage
from tandem.protocol.final_info import FinalInfo
from tests.scripted_engine import KEY, NAME, Reply, scripted_app
from tests.served import Served

AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FINAL_KEYS = {"done_reason", "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
              "eval_count", "eval_duration"}


@pytest.fixture(scope="module")
def scripted(qwen3):
    return scripted_app(qwen3, "qwen3")


def _pieces(text: str, step: int = 3) -> list[str]:
    return [text[i:i + step] for i in range(0, len(text), step)]


def _run(app, body, headers: dict | None = AUTH):
    async def go():
        transport = httpx.ASGITransport(app=app)
        client = ollama.AsyncClient(host="http://scripted", transport=transport, headers=headers)
        raw = httpx.AsyncClient(transport=transport, base_url="http://scripted", headers=headers)
        try:
            return await body(client, raw)
        finally:
            await client._client.aclose()
            await raw.aclose()
    return asyncio.run(go())


def test_chat_whole_and_streamed_add_up(scripted, tok) -> None:
    engine, app = scripted
    text = "<think>\nThey want weather.\n</think>\n\nIt is sunny."

    async def body(c, raw):
        engine.script(_pieces(text))
        whole = await c.chat(model=f"{NAME}:latest", messages=USER, stream=False)
        engine.script(_pieces(text))
        parts = [p async for p in await c.chat(model=NAME, messages=USER, stream=True)]
        engine.script(_pieces(text))
        r = await raw.post("/api/chat", json={"model": NAME, "messages": USER})  # stream by default
        return whole, parts, r

    whole, parts, r = _run(app, body)
    assert tok.decode(engine.prompts[-1]) == "<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert whole.model == f"{NAME}:latest" and whole.done and whole.done_reason == "stop"
    assert whole.message.role == "assistant" and whole.message.content == "It is sunny."
    assert whole.message.thinking == "They want weather." and not whole.message.tool_calls
    assert whole.prompt_eval_count == len(engine.prompts[0]) and whole.eval_count == len(_pieces(text))
    assert whole.total_duration > 0 and whole.load_duration == 0 and whole.created_at.endswith("Z")
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    last = parts[-1].model_dump(exclude_none=True)
    assert FINAL_KEYS <= set(last) and last["message"] == {"role": "assistant", "content": ""}
    assert last["eval_count"] == whole.eval_count
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert set(lines[0]) == {"model", "created_at", "message", "done"} and lines[-1]["done"] is True
    assert "".join(x["message"]["content"] for x in lines) == "It is sunny."


def test_think_switch_and_empty_messages(scripted, tok) -> None:
    engine, app = scripted

    async def body(c, raw):
        await c.chat(model=NAME, messages=USER, think=False, stream=False)
        history = [*USER, {"role": "assistant", "content": None, "thinking": "hm"}, *USER]  # null: empty
        assert (await raw.post("/api/chat", json={"model": NAME, "messages": history, "stream": False})).json()["done"]
        loaded = (await raw.post("/api/chat", json={"model": NAME, "messages": []})).json()
        return loaded

    n = len(engine.prompts)
    loaded = _run(app, body)
    assert tok.decode(engine.prompts[n]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(engine.prompts[n + 1]).count("<|im_start|>assistant\n<|im_end|>") == 1
    assert len(engine.prompts) == n + 2  # nothing to generate: no engine request
    assert loaded["done"] is True and loaded["done_reason"] == "load"
    assert loaded["message"] == {"role": "assistant", "content": ""} and loaded["model"] == NAME


def test_generate_context_options_and_formats(scripted, tok) -> None:
    engine, app = scripted

    async def body(c, raw):
        engine.script(["Hi", " there"])
        first = await c.generate(model=NAME, prompt="hello", system="Be brief.", options={
            "num_predict": 7, "stop": ["\n\n", ""], "temperature": 0, "top_k": 0, "seed": -1, "top_p": 0.5,
            "min_p": 0.1, "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25,
            "num_ctx": 4096, "mirostat": 2, "num_thread": 4, "typical_p": 0.9, "repeat_last_n": 64,
        }, format="json")
        engine.script(["Again"])
        parts = [p async for p in await c.generate(model=NAME, prompt="more", context=first.context,
                                                     format=SCHEMA, stream=True,
                                                     options={"num_predict": -1, "seed": 5, "top_k": 40})]
        engine.script(["raw"])
        plain = await c.generate(model=NAME, prompt="raw text", raw=True, keep_alive="5m", logprobs=True,
                                 top_logprobs=3)
        empty = await c.generate(model=NAME, prompt="")
        return first, parts, plain, empty

    n = len(engine.prompts)
    first, parts, plain, empty = _run(app, body)
    p1, p2, p3 = engine.prompts[n:]
    assert tok.decode(p1) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert engine.params[n] == {
        "max_tokens": 7, "stop": ["\n\n"], "temperature": 0.0, "top_k": -1, "top_p": 0.5, "min_p": 0.1,
        "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25, "json_object": True}
    assert first.response == "Hi there" and first.done and first.done_reason == "stop"
    assert first.context == p1 + [0, 1]  # the prompt and the (scripted) output ids
    assert p2[: len(first.context)] == first.context and tok.decode(p2[len(first.context):]).startswith(
        "<|im_start|>user\nmore")
    assert engine.params[n + 1] == {"json_schema": SCHEMA, "seed": 5, "top_k": 40}
    assert "".join(p.response for p in parts) == "Again" and parts[-1].context == p2 + [0]
    assert [p.done for p in parts][-2:] == [False, True] and parts[-1].response == ""
    assert p3 == tok.encode("raw text") and plain.response == "raw" and plain.context is None
    assert engine.params[n + 2] == {"logprobs": 3}
    assert empty.done and empty.done_reason == "load" and empty.response == "" and len(engine.prompts) == n + 3


def test_num_predict_cuts_and_says_length(scripted) -> None:
    engine, app = scripted

    async def body(c, raw):
        engine.script(Reply(["a", "b"], finish_reason="length"))
        return await c.chat(model=NAME, messages=USER, options={"num_predict": 2}, stream=False)

    r = _run(app, body)
    assert engine.params[-1] == {"max_tokens": 2} and r.done_reason == "length" and r.eval_count == 2


def test_tools_whole_streamed_and_tool_results(scripted, tok) -> None:
    engine, app = scripted
    text = f"Checking.\n{CALL}\n{CALL.replace('Paris', 'Oslo')}"

    async def body(c, raw):
        engine.script(_pieces(text, 5))
        whole = await c.chat(model=NAME, messages=USER, tools=TOOLS, stream=False)
        engine.script(_pieces(text, 5))
        parts = [p async for p in await c.chat(model=NAME, messages=USER, tools=TOOLS, stream=True)]
        engine.script(Reply(_pieces(CALL[:-20], 5), finish_reason="length"))  # cut off inside the call
        cut = await c.chat(model=NAME, messages=USER, tools=TOOLS, stream=False)
        return whole, parts, cut

    whole, parts, cut = _run(app, body)
    calls = [c.model_dump() for c in whole.message.tool_calls]
    assert calls == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                     {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert whole.message.content == "Checking." and whole.done_reason == "stop"
    streamed = [c.model_dump() for p in parts for c in p.message.tool_calls or []]
    assert streamed == calls and "".join(p.message.content for p in parts) == "Checking."
    assert sum(1 for p in parts if p.message.tool_calls) == 2  # each call once, as soon as it is whole
    assert not cut.message.tool_calls and cut.done_reason == "length"
    # The request after: the calls and their results (tool_name) reach the template as the chat route's.
    msgs = ollama_chat_messages([OllamaMessage.model_validate(m) for m in [
        *USER, {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "rain", "tool_name": "get_weather"},
        {"role": "tool", "content": "sun", "tool_name": "get_weather"}]])
    ids = [c.id for c in msgs[1].tool_calls]
    assert [m.tool_call_id for m in msgs[2:]] == ids and len(set(ids)) == 2
    assert json.loads(msgs[1].tool_calls[0].function.arguments) == {"city": "Paris"}
    assert msgs[2].name == "get_weather" and msgs[2].content == "rain"


def test_embed(scripted) -> None:
    engine, app = scripted
    got: list = []

    async def embed_batch(inputs, *, dimensions=None, normalize=True, priority=0):
        got.append((list(inputs), dimensions))
        return [Embedding(f"e{i}", struct.pack("<2f", 0.5, float(i)),
                          FinalInfo("stop", None, len(x) if isinstance(x, list) else 3))
                for i, x in enumerate(inputs)]

    engine.embed_batch = embed_batch

    async def body(c, raw):
        one = await c.embed(model=NAME, input="abc")
        two = await c.embed(model=f"{NAME}:latest", input=["abc", "x " * 3000], dimensions=2,
                            options={"num_ctx": 8})
        whole = (await raw.post("/api/embed", json={"model": NAME, "input": "x " * 3000, "truncate": False}))
        none = (await raw.post("/api/embed", json={"model": NAME, "input": []})).json()
        return one, two, whole, none

    one, two, whole, none = _run(app, body)
    assert one.model == NAME and one.embeddings == [[0.5, 0.0]] and one.prompt_eval_count == 3
    assert two.embeddings == [[0.5, 0.0], [0.5, 1.0]] and two.model == f"{NAME}:latest"
    assert set(one.model_dump(exclude_none=True)) == {"model", "embeddings", "total_duration",
                                                        "load_duration", "prompt_eval_count"}
    assert got[0] == (["abc"], None)
    ids, dims = got[1]  # the long input cut to the context length (2048), so every input goes as ids
    assert dims == 2 and [len(x) for x in ids] == [len(ids[0]), 2048] and ids[0] != "abc"
    assert whole.status_code == 200 and got[2][0] == ["x " * 3000]  # truncate false: as given
    assert none["embeddings"] == []


def test_listing_show_and_version(scripted, qwen3) -> None:
    engine, app = scripted

    async def body(c, raw):
        return (await c.list(), await c.ps(), await c.show(f"{NAME}:latest"),
                (await raw.post("/api/show", json={"name": NAME})).json(),
                (await raw.get("/api/tags")).json(),
                (await raw.get("/api/ps")).json(), (await raw.get("/api/version", headers={})).json())

    listed, running, shown, by_name, tags, ps, version = _run(app, body)
    entry = tags["models"][0]
    assert set(entry) == {"name", "model", "modified_at", "size", "digest", "details"}
    assert entry["name"] == entry["model"] == f"{NAME}:latest" and entry["modified_at"].endswith("Z")
    size = sum(f.stat().st_size for f in qwen3.rglob("*") if f.is_file())
    assert entry["size"] == size and len(entry["digest"]) == 64
    assert entry["details"] == {"parent_model": "", "format": "safetensors", "family": "qwen3",
                                "families": ["qwen3"], "parameter_size": entry["details"]["parameter_size"],
                                "quantization_level": "F32"}
    assert entry["details"]["parameter_size"].endswith("K")
    assert listed.models[0].model == f"{NAME}:latest" and listed.models[0].size == size
    p = ps["models"][0]
    assert set(p) == set(entry) | {"expires_at", "size_vram", "context_length"} and p["size_vram"] == 0
    assert p["digest"] == entry["digest"] and running.models[0].expires_at.year > 2030
    assert shown.capabilities == ["completion", "thinking", "embedding"] and "<|im_start|>" in shown.template
    info = shown.modelinfo
    assert info["general.architecture"] == "qwen3" and info["qwen3.context_length"] == 2048
    assert info["qwen3.embedding_length"] == 64 and info["qwen3.block_count"] == 2
    assert info["general.parameter_count"] > 0 and shown.details.family == "qwen3"
    assert "FROM " in shown.modelfile and "num_ctx" in shown.parameters
    assert by_name["details"] == shown.details.model_dump() and version == {"version": version["version"]}
    assert human_number(8_030_261_248) == "8.0B" and human_number(135_000_000) == "135M"
    assert human_number(134_515_008) == "134.52M" and human_number(7_000_000_000) == "7B"
    # what a router lists for a model not on disk yet
    absent = ollama_model_entry("later", "/nowhere/at/all", None, None)
    assert absent["name"] == "later:latest" and absent["size"] == 0 and absent["details"]["format"] == ""
    assert ollama_model_entry("m:q4", str(qwen3), None, "2030-01-01T00:00:00Z")["name"] == "m:q4"


def test_errors_in_ollamas_shape(scripted) -> None:
    engine, app = scripted
    engine.script(Reply([], error=ValueError("never reached")))  # consumed by the fault case below

    async def body(c, raw):
        found = []
        for call in (
            lambda: c.chat(model="nope", messages=USER),
            lambda: c.generate(model=NAME, prompt="x", options={"bogus": 1}),
            lambda: c.generate(model=NAME, prompt="x", options={"temperature": "hot"}),
            lambda: c.generate(model=NAME, prompt="x", images=["aGk="]),
            lambda: c.chat(model=NAME, messages=[{"role": "user", "content": "x", "images": ["aGk="]}]),
            lambda: c.generate(model=NAME, prompt="x", template="{{ .Prompt }}"),
            lambda: c.generate(model=NAME, prompt="x", suffix="end"),
            lambda: c.show("nope"),
            lambda: c.embed(model="nope", input="x"),
        ):
            with pytest.raises(ollama.ResponseError) as e:
                await call()
            found.append((e.value.status_code, e.value.error))
        bad_json = await raw.post("/api/chat", content=b"{not json", headers={"content-type": "application/json"})
        extra = await raw.post("/api/generate", json={"model": NAME, "prompt": "x", "bogus": 1, "nothing": None})
        no_key = await raw.get("/api/tags", headers={"Authorization": "Bearer wrong"})
        nowhere = await raw.post("/api/pull", json={"model": NAME})
        no_model = await raw.post("/api/show", json={})
        return found, bad_json, extra, no_key, nowhere, no_model

    engine.replies.clear()
    found, bad_json, extra, no_key, nowhere, no_model = _run(app, body)
    assert no_model.status_code == 400 and no_model.json() == {"error": "model is required"}
    assert found[0] == (404, "model 'nope' not found") and found[7] == (404, "model 'nope' not found")
    assert found[8] == (404, "model 'nope' not found")
    assert found[1][0] == 400 and "'bogus'" in found[1][1] and "num_ctx" in found[1][1]
    assert found[2][0] == 400 and found[2][1].startswith("options.temperature: ")
    assert found[3] == found[4] == (400, TEXT_ONLY)
    assert found[5][0] == found[6][0] == 400 and "template" in found[5][1] and "insert" in found[6][1]
    for r, status in ((bad_json, 400), (extra, 400), (no_key, 401), (nowhere, 404)):
        assert r.status_code == status and set(r.json()) == {"error"} and r.json()["error"], r.text
    assert "bogus" in extra.json()["error"] and "nothing" not in extra.json()["error"]


def test_engine_errors_whole_and_mid_stream(scripted) -> None:
    from tandem.protocol.errors import InvalidRequestError, RequestFailedError

    engine, app = scripted

    async def body(c, raw):
        engine.script(Reply([], error=InvalidRequestError("bad grammar")))
        with pytest.raises(ollama.ResponseError) as up_front:
            [p async for p in await c.chat(model=NAME, messages=USER, stream=True)]
        engine.script(Reply(["a", "b"], fault=RequestFailedError("kv gone")))
        r = await raw.post("/api/generate", json={"model": NAME, "prompt": "x"})
        return up_front.value, r

    up_front, r = _run(app, body)
    assert up_front.status_code == 400 and up_front.error == "bad grammar"
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert r.status_code == 200 and lines[-1] == {"error": "kv gone"} and lines[0]["response"] == "a"


def test_a_client_that_leaves_aborts(scripted) -> None:
    engine, app = scripted

    async def endless(prompt, params, rid, priority=0, session=None):
        engine.prompts.append(list(prompt))
        i = 0
        while rid not in engine.aborted:
            yield CompletionDelta(rid, "x", [i])
            i += 1
            await asyncio.sleep(0.002)
        yield CompletionDelta(rid, "", [], FinalInfo("abort", None, len(prompt), i))

    async def leave(path: str, body: dict) -> None:
        """The request straight to the app; its client goes once an answer's first bytes came (streamed),
        or once the engine runs it (whole)."""
        sent, before, gone = False, len(engine.prompts), asyncio.Event()

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.body" and msg.get("body"):
                gone.set()

        async def watch():
            while len(engine.prompts) == before:
                await asyncio.sleep(0.005)
            if not body["stream"]:
                gone.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": b"", "client": ("t", 1), "server": ("t", 80),
                 "headers": [(b"content-type", b"application/json"),
                             (b"authorization", AUTH["Authorization"].encode())]}
        watcher = asyncio.ensure_future(watch())
        with contextlib.suppress(asyncio.CancelledError):  # a whole answer's wait ends so
            await asyncio.wait_for(app(scope, receive, send), 10)
        watcher.cancel()

    real, engine.stream = engine.stream, endless
    try:
        for path, body in (("/api/chat", {"messages": USER, "stream": True}),
                           ("/api/generate", {"prompt": "x", "stream": True}),
                           ("/api/chat", {"messages": USER, "stream": False})):
            aborted = len(engine.aborted)
            asyncio.run(leave(path, {"model": NAME, **body}))
            assert len(engine.aborted) == aborted + 1, (path, body)
    finally:
        engine.stream = real


def test_openapi_documents_the_routes(scripted) -> None:
    _, app = scripted

    async def body(c, raw):
        return (await raw.get("/openapi.json")).json()

    doc = _run(app, body)
    for path in ("/api/chat", "/api/generate"):
        answers = doc["paths"][path]["post"]["responses"]
        assert "application/x-ndjson" in answers["200"]["content"]
        assert answers["404"]["content"]["application/json"]["schema"]["properties"]["error"] == {"type": "string"}
    assert {"/api/embed", "/api/show", "/api/tags", "/api/ps", "/api/version"} <= set(doc["paths"])


def test_served_greedy_text_equals_the_openai_routes(tiny_model) -> None:
    served = Served(tiny_model("qwen3"), "--kv-cache-tokens", "4096", "--served-model-name", NAME).ready()
    try:
        url = served.url
        c = ollama.Client(host=url)
        opts = {"temperature": 0, "num_predict": 12}
        msgs = [{"role": "user", "content": "Hello there"}]

        def openai(path: str, **body) -> str:
            r = httpx.post(url + path, json={"model": NAME, "max_tokens": 12, "temperature": 0, **body},
                           timeout=60).json()
            ch = r["choices"][0]
            return ch["text"] if "text" in ch else ch["message"]["content"]

        chat_ref = openai("/v1/chat/completions", messages=msgs)
        assert len(chat_ref) > 12  # a whole reply, not an end-of-sequence after a token or two
        assert c.chat(model=NAME, messages=msgs, options=opts, stream=False).message.content == chat_ref
        parts = list(c.chat(model=f"{NAME}:latest", messages=msgs, options=opts, stream=True))
        assert "".join(p.message.content for p in parts) == chat_ref and parts[-1].eval_count == 12
        gen = c.generate(model=NAME, prompt="Hello there", options=opts, stream=False)
        assert gen.response == chat_ref and gen.done_reason == "length" and gen.eval_count == 12
        assert gen.prompt_eval_count + 12 == len(gen.context) and gen.eval_duration > 0
        streamed = c.generate(model=NAME, prompt="Hello there", options=opts, stream=True)
        assert "".join(p.response for p in streamed) == chat_ref
        raw_ref = openai("/v1/completions", prompt="Hello there")
        raw = c.generate(model=NAME, prompt="Hello there", raw=True, options=opts, logprobs=True, top_logprobs=2)
        assert raw.response == raw_ref and "".join(lp.token for lp in raw.logprobs) == raw_ref
        assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in raw.logprobs)
        emb = c.embed(model=NAME, input=["Hello there", "bye"])
        ref = httpx.post(url + "/v1/embeddings", json={"model": NAME, "input": ["Hello there", "bye"]},
                         timeout=60).json()
        assert [list(e) for e in emb.embeddings] == [d["embedding"] for d in ref["data"]]
        assert emb.prompt_eval_count == ref["usage"]["prompt_tokens"]
    finally:
        assert served.close() == 0

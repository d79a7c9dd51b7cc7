"""The OpenAI-compatible HTTP server through the official `openai` client, against one served tiny model."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.conftest import check_idle_engine
from tests.served import Served

KEY = "sk-test-key"
NAME = "tiny-llama"


@pytest.fixture(scope="module")
def served(tiny_model):
    s = Served(tiny_model("llama"), "--kv-cache-tokens", "8192", "--max-running-requests", "32",
               "--api-key", KEY, "--served-model-name", NAME).ready()
    yield s
    assert s.close() == 0


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(served):
    from tandem import Client

    c = Client(served.endpoint)
    yield c
    c.close()


def _metric(served, name: str) -> float:
    text = httpx.get(served.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(2))
    return total


def test_completion_is_what_the_engine_generates(oai, engine) -> None:
    r = oai.completions.create(model=NAME, prompt="The river", max_tokens=12, temperature=0)
    ref = engine.generate("The river", {"max_tokens": 12, "temperature": 0.0})
    assert r.model == NAME and r.object == "text_completion"
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (
        r.usage.prompt_tokens == ref.prompt_tokens
        and r.usage.completion_tokens == ref.completion_tokens == 12
    )
    m = ref.metrics  # the scheduler's timeline, returned with the final output
    assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s and m.decode_s > 0 and m.retractions == []
    assert m.e2e_s == pytest.approx(m.ttft_s + m.decode_s)
    # Streamed, the same text arrives in pieces, then a usage-only chunk.
    chunks = list(
        oai.completions.create(
            model=NAME,
            prompt="The river",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompt_and_batch_of_prompts(oai, engine) -> None:
    ids = [5, 6, 7, 8, 9]
    ref = engine.generate(ids, {"max_tokens": 6, "temperature": 0.0})
    r = oai.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == ref.text
    r2 = oai.completions.create(model=NAME, prompt=["a b", "c d e"], max_tokens=4, temperature=0)
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.usage.completion_tokens == 8


def test_chat_stream_equals_whole(oai, engine) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
    ]
    r = oai.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=10, temperature=0)
    ref = engine.generate(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        {"max_tokens": 10, "temperature": 0.0},
    )
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == ref.prompt_tokens
    chunks = list(
        oai.chat.completions.create(
            model=NAME,
            messages=msgs,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.total_tokens == ref.prompt_tokens + 10


def test_n_choices_and_seeds(oai) -> None:
    kw = dict(model=NAME, prompt="Once upon", max_tokens=8, temperature=1.0, n=3, seed=11)
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # but the choices differ from each other
    assert a.usage.completion_tokens == 24
    # The prompt is counted once; its choices after the first share its prefix in the cache.
    single = oai.completions.create(model=NAME, prompt="Once upon", max_tokens=1)
    assert a.usage.prompt_tokens == single.usage.prompt_tokens
    chat = oai.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4
    )
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_logprobs_both_formats(oai) -> None:
    r = oai.completions.create(model=NAME, prompt="The sky", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for v, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(v, abs=1e-4)  # greedy: the chosen token is the top one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    echo = oai.completions.create(
        model=NAME, prompt="The sky", max_tokens=3, temperature=0, logprobs=1, echo=True
    )
    e = echo.choices[0]
    assert e.text.startswith("The sky") and e.logprobs.token_logprobs[0] is None
    assert len(e.logprobs.tokens) == echo.usage.prompt_tokens + 3
    c = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and "".join(x.token for x in content) == c.choices[0].message.content
    assert all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in content)


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "size": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["color", "size"], "additionalProperties": False}


def test_response_format_json_schema(oai) -> None:
    for seed in range(3):
        r = oai.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "a shirt"}], max_tokens=40, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = oai.completions.create(model=NAME, prompt="json:", max_tokens=30, seed=1,
                               extra_body={"response_format": {"type": "json_schema",
                                                               "json_schema": {"schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["UTC", "CET"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]


def _streamed_choice(chunks: list) -> tuple[str | None, list[tuple[str, str]], str | None, int]:
    """What a streaming client builds of choice 0: content, (name, arguments) per call, finish reason, and
    how many chunks carried argument text."""
    content, names, args, pieces = None, {}, {}, 0
    for c in chunks:
        d = c.choices[0].delta
        if d.content:
            content = (content or "") + d.content
        for tc in d.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in names and tc.function.name
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
            pieces += bool(tc.function.arguments)
    return content, [(names[i], args[i]) for i in sorted(names)], chunks[-1].choices[0].finish_reason, pieces


HERMES = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
          r'"days": [1-9]\}\}\n</tool_call>')


def test_tool_calls(oai) -> None:
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    r = oai.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, max_tokens=40,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in (
        "Paris",
        "Oslo",
    )
    # One call at most (parallel_tool_calls=False), so the random model's JSON always closes within
    # max_tokens;
    # with parallel calls allowed it may keep adding items until max_tokens cuts the array ("length").
    r = oai.chat.completions.create(
        model=NAME,
        messages=msgs,
        tools=TOOLS,
        max_tokens=60,
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    )
    _, calls, finish, _ = _streamed_choice(list(r))
    assert len(calls) == 1 and calls[0][0] in ("get_weather", "get_time") and json.loads(calls[0][1])
    assert finish == "tool_calls"
    # The result goes back in as a tool message and an assistant message with tool_calls.
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = oai.chat.completions.create(model=NAME, messages=follow, tools=TOOLS, max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("how", ["named", "required", "hermes"])
def test_tool_calls_stream_as_they_grow(oai, how) -> None:
    kw: dict = dict(
        model=NAME,
        messages=[{"role": "user", "content": "weather?"}],
        tools=TOOLS,
        max_tokens=200,
        temperature=1.0,
        seed=5,
    )
    if how == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
    elif how == "required":
        kw.update(tool_choice="required", parallel_tool_calls=False)
    else:  # the model's own format, forced here by a regex since a random model never writes it
        kw["extra_body"] = {"regex": HERMES}
    whole = oai.chat.completions.create(**kw).choices[0]
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    content, calls, finish, pieces = _streamed_choice(chunks)
    assert whole.finish_reason == finish == "tool_calls"
    assert content == whole.message.content
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len(calls) == 1 and json.loads(calls[0][1])
    assert pieces > 1  # the arguments came in fragments, not at the end in one piece
    if how == "hermes":
        assert content == "Checking." and calls[0][0] == "get_weather"
        first_call = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
        assert "".join(c.choices[0].delta.content or "" for c in chunks[:first_call]) == "Checking."


def test_stop_strings(oai) -> None:
    full = oai.completions.create(model=NAME, prompt="Tell", max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert len(stop) == 2
    r = oai.completions.create(
        model=NAME, prompt="Tell", max_tokens=24, temperature=0, stop=[stop, "\x00never"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]


def _err(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_errors_in_openai_shape(served, oai) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and _err(e.value)["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/v1/models").status_code == 401  # no key at all
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert _err(e.value)["param"] == "model" and _err(e.value)["code"] == "model_not_found"
    bad = [({"temperature": -1}, "temperature"), ({"n": 0}, "n"), ({"extra_body": {"top_kk": 3}}, "top_kk"),
           ({"logprobs": 99}, "logprobs"), ({"extra_body": {"top_k": 0}}, None),
           ({"max_tokens": 100000}, None), ({"extra_body": {"regex": "("}}, None)]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=NAME, prompt="x", **{"max_tokens": 2, **kw})
        err = _err(e.value)
        assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"], kw
        if param is not None:
            assert err["param"] == param, (kw, err)
    with pytest.raises(openai.BadRequestError) as e:  # a bad chat message part
        oai.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": [{"type": "image_url"}]}]
        )
    assert _err(e.value)["param"].startswith("messages")
    r = httpx.post(
        served.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, content=b"{not json"
    )
    assert r.status_code == 400 and "error" in r.json()
    # Streaming: an error the engine reports up front is an HTTP status too, not a broken stream.
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=NAME, prompt="x", max_tokens=2, stream=True, extra_body={"top_k": 0})
    assert (
        oai.completions.create(model=NAME, prompt="still serving", max_tokens=2).choices[0].text is not None
    )


def test_no_operator_route_without_an_admin_key(served, oai) -> None:
    """Served without --admin-api-key: POST /drain is no route at all, whoever asks (the inference key too),
    and the server keeps serving; the OpenAPI document does not list it."""
    for headers in ({}, {"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        r = httpx.post(served.url + "/drain", headers=headers)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert "/drain" not in httpx.get(served.url + "/openapi.json").json()["paths"]
    assert httpx.get(served.url + "/health").status_code == 200
    out = oai.completions.create(
        model=NAME, prompt="still serving", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 2


def test_tokenize_detokenize_models_version_health(served, oai, engine) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    t = httpx.post(served.url + "/tokenize", json={"model": NAME, "prompt": "hello world"}, headers=h).json()
    assert t["count"] == len(t["tokens"]) > 0
    d = httpx.post(served.url + "/detokenize", json={"tokens": t["tokens"]}, headers=h).json()
    assert d["prompt"].endswith("hello world")
    assert httpx.post(served.url + "/detokenize", json={"tokens": [10**9]}, headers=h).status_code == 400
    tc = httpx.post(
        served.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=h
    ).json()
    ref = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert tc["count"] == ref.usage.prompt_tokens
    models = oai.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].model_extra["root"].endswith("llama-tiny")
    assert httpx.get(served.url + "/version").json()["version"]
    assert httpx.get(served.url + "/health").status_code == 200


def test_metrics_move(served, oai) -> None:
    before = {
        k: _metric(served, f"tandem:{k}")
        for k in (
            "generation_tokens_total",
            "prompt_tokens_total",
            "request_success_total",
            "e2e_request_latency_seconds_count",
            "time_to_first_token_seconds_count",
            "inter_token_latency_seconds_count",
            "prefix_cache_queries_total",
            "prefix_cache_hits_total",
            "request_queue_time_seconds_count",
        )
    }
    stream = oai.completions.create(model=NAME, prompt="The long road " * 4, max_tokens=200, stream=True,
                                    extra_body={"ignore_eos": True})
    seen_running = 0.0
    for i, _ in enumerate(stream):
        if i == 3:
            seen_running = _metric(served, "tandem:num_requests_running")
            assert _metric(served, "tandem:kv_cache_usage_perc") > 0
    assert seen_running >= 1
    # the same prompt: cached
    r = oai.completions.create(model=NAME, prompt="The long road " * 4, max_tokens=5)
    after = {k: _metric(served, f"tandem:{k}") for k in before}
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 205
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 2 * r.usage.prompt_tokens
    for k in (
        "request_success_total",
        "e2e_request_latency_seconds_count",
        "time_to_first_token_seconds_count",
        "request_queue_time_seconds_count",
    ):
        assert after[k] - before[k] == 2, k
    assert after["inter_token_latency_seconds_count"] - before["inter_token_latency_seconds_count"] >= 199
    assert (
        after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
        == 2 * r.usage.prompt_tokens
    )
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= r.usage.prompt_tokens - 1
    assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 1
    assert 'finished_reason="length"' in httpx.get(served.url + "/metrics").text


def _wait_idle(engine) -> None:
    deadline = time.monotonic() + 20
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.1)
    check_idle_engine(engine)


def test_disconnect_aborts(served, engine) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": "Go on", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=h, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: {") for x in got)
        assert engine.stats().running == 1
    # Closed mid-stream: the engine ends the request long before its 1500 tokens.
    _wait_idle(engine)
    assert engine.stats().requests_aborted >= 1
    deadline = time.monotonic() + 10  # the abort's final output reaches the metrics too
    while _metric(served, "tandem:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(served, "tandem:num_requests_running") == 0
    aborted = engine.stats().requests_aborted

    async def give_up() -> None:  # a whole-response request whose client goes once it runs, not on a clock
        async with httpx.AsyncClient(timeout=60) as ac:
            task = asyncio.ensure_future(ac.post(served.url + "/v1/chat/completions", headers=h, json={
                "model": NAME, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500,
                "ignore_eos": True}))
            while engine.stats().running == 0 and not task.done():
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(give_up())
    _wait_idle(engine)
    assert engine.stats().requests_aborted == aborted + 1


def test_bench_serve_against_the_server(served, tmp_path, tiny_model, capsys) -> None:
    from tandem.benchmarks.cli import main as bench_main

    out = tmp_path / "res"
    assert (
        bench_main(
            [
                "serve",
                "--base-url",
                served.url,
                "--model",
                NAME,
                "--api-key",
                KEY,
                "--tokenizer",
                str(tiny_model("llama")),
                "--dataset",
                "shared-prefix",
                "--prefix-len",
                "32",
                "--num-prompts",
                "6",
                "--input-len",
                "4:8",
                "--output-len",
                "3:5",
                "--request-rate",
                "50,inf",
                "--max-concurrency",
                "4",
                "--slo-ttft-ms",
                "60000",
                "--label",
                "t",
                "--result-dir",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads((out / "t.json").read_text())["results"]
    assert [r["request_rate"] for r in res] == [50.0, "inf"]
    for r in res:
        assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
        assert r["total_output_tokens"] == sum(r["output_lens"]) and all(
            3 <= n <= 5 for n in r["output_lens"]
        )
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_e2el_ms"] >= r["mean_ttft_ms"]
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a generous SLO: every request
        assert sum(r["output_throughput_timeline"]) == pytest.approx(r["total_output_tokens"])
    assert sorted(p.name for p in out.glob("*.png")) == [
        "t_latency.png",
        "t_throughput.png",
        "t_timeline.png",
    ]
    # Runs side by side: one PNG and a markdown table, a row per server and rate; other rates are refused.
    from tandem.benchmarks import serve_compare

    capsys.readouterr()
    assert serve_compare.main(["--out", str(out / "cmp.png"), str(out / "t.json"), str(out / "t.json")]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert (
        len(rows) == 2 + 4 and rows[2].startswith("| t | 50.0 | 6/6 |") and (out / "cmp.png").stat().st_size
    )
    other = json.loads((out / "t.json").read_text())
    other["results"] = other["results"][:1]
    (out / "u.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different request rates"):
        serve_compare.main(["--out", str(out / "cmp2.png"), str(out / "t.json"), str(out / "u.json")])

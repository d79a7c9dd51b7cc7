"""Through the whole stack: seeded sampling, streamed text, the async client, aborts, bad input."""
from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from tandem import AsyncClient, InvalidRequestError, SamplingParams
from tests.conftest import check_idle_engine


@pytest.fixture(scope="module")
def engine(tiny_model, request):
    from tandem import Client

    model = tiny_model("qwen3")
    client = Client.launch(str(model), dtype="float32", kv_cache_tokens=8192, max_running_requests=32)
    request.addfinalizer(client.close)
    return model, client


def test_seeded_sampling_reproducible_across_runs_and_batches(engine) -> None:
    model, client = engine
    prompt = [11, 22, 33, 44, 55]
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone1 = client.generate(prompt, p).token_ids
    alone2 = client.generate(prompt, p).token_ids
    others = [[7] * n for n in (3, 40, 90)]
    batch = client.generate_batch(
        [others[0], prompt, others[1], others[2]],
        [
            SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True),
            p,
            SamplingParams(max_tokens=10, seed=5, ignore_eos=True),
            SamplingParams(max_tokens=20, ignore_eos=True),
        ],
        progress=False,
    )
    assert alone1 == alone2 == batch[1].token_ids
    other_seed = client.generate(prompt, SamplingParams(**{**_fields(p), "seed": 4321})).token_ids
    assert other_seed != alone1
    check_idle_engine(client)


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_stream_concatenation_equals_full_decode_cjk_and_emoji(engine) -> None:
    model, client = engine
    tok = AutoTokenizer.from_pretrained(str(model))
    for i, prompt in enumerate(
        ["你好，世界！今天天气很好。", "東京の夜 🌃 and emoji 👨‍👩‍👧 🇯🇵", "混合 text 😀 with 中文"]
    ):
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=i, ignore_eos=True)
        deltas = list(client.stream(prompt, params))
        ids = [t for d in deltas for t in d.token_ids]
        text = "".join(d.text for d in deltas)
        assert len(ids) == 48 and deltas[-1].finished
        assert text == tok.decode(ids, skip_special_tokens=True)
    check_idle_engine(client)


def test_chat_messages_use_the_template(engine) -> None:
    model, client = engine
    tok = AutoTokenizer.from_pretrained(str(model))
    msgs = [{"role": "user", "content": "写一首诗"}]
    out = client.generate(msgs, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert out.prompt_tokens == len(want)


def test_abort_while_decoding_ends_once_and_frees_kv(engine) -> None:
    _, client = engine
    stream = client.stream([1, 2, 3], SamplingParams(max_tokens=1500, ignore_eos=True), request_id="to-abort")
    first = next(stream)
    client.abort("to-abort")
    rest = list(stream)
    ends = [d for d in [first, *rest] if d.finished]
    assert len(ends) == 1 and ends[0].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in [first, *rest]) < 1500
    check_idle_engine(client)


@pytest.mark.parametrize(
    "prompt, params, code",
    [
        ("", {"max_tokens": 4}, "invalid_request.empty_prompt"),
        ([], {"max_tokens": 4}, "invalid_request.empty_prompt"),
        ([1, 2, 999_999], {"max_tokens": 4}, "invalid_request.token_id"),
        ([1] * 3000, {"max_tokens": 4}, "invalid_request.prompt_too_long"),
        ([1, 2], {"max_tokens": 5000}, "invalid_request.prompt_too_long"),
        ([1, 2], {"max_tokens": 0}, "invalid_request.params"),
        ([1, 2], {"temperature": -0.5}, "invalid_request.params"),
        ([1, 2], {"top_p": 0.0}, "invalid_request.params"),
        ([1, 2], {"top_p": 1.5}, "invalid_request.params"),
        ([1, 2], {"top_k": 0}, "invalid_request.params"),
        ([1, 2], {"top_k": -2}, "invalid_request.params"),
        ([1, 2], {"temprature": 0.5}, "invalid_request.params"),
        ([1, 2], {"max_tokens": "many"}, "invalid_request.params"),
        ([1, 2], {"min_p": 1.5}, "invalid_request.params"),
        ([1, 2], {"presence_penalty": 2.5}, "invalid_request.params"),
        ([1, 2], {"frequency_penalty": -3}, "invalid_request.params"),
        ([1, 2], {"repetition_penalty": 0.0}, "invalid_request.params"),
        ([1, 2], {"logprobs": 21}, "invalid_request.params"),
        ([1, 2], {"prompt_logprobs": -1}, "invalid_request.params"),
        ([1, 2], {"stop": ["s"] * 17}, "invalid_request.params"),
        ([1, 2], {"stop": [""]}, "invalid_request.params"),
        ([1, 2], {"stop": "not a list"}, "invalid_request.params"),
        ([1, 2], {"min_tokens": 9, "max_tokens": 4}, "invalid_request.params"),
        ([1, 2], {"seed": -1}, "invalid_request.params"),
        ([1, 2], {"stop_token_ids": [5000]}, "invalid_request.token_id"),
        ([{"role": "user"}], {}, "invalid_request.messages"),
    ],
)
def test_bad_input_is_a_typed_error_and_the_engine_keeps_serving(engine, prompt, params, code) -> None:
    _, client = engine
    with pytest.raises(InvalidRequestError) as e:
        client.generate(prompt, params)
    assert e.value.code == code, e.value
    ok = client.generate([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    assert ok.completion_tokens == 3


def test_async_client_matches_sync(engine) -> None:
    model, client = engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11], "异步 client"]
    want = [c.token_ids for c in client.generate_batch(prompts, params, progress=False)]

    async def go() -> list[list[int]]:
        async with AsyncClient(client.endpoint) as ac:
            outs = await ac.generate_batch(prompts, params, progress=False)
            streamed = [d async for d in ac.stream(prompts[0], params)]
            assert [t for d in streamed for t in d.token_ids] == outs[0].token_ids
            st = await ac.stats()
            assert st.integrity == "ok"
            return [o.token_ids for o in outs]

    assert asyncio.run(go()) == want

"""Issue-3 behaviour through the whole stack: prefix reuse, KV pressure with retraction, stop strings,
min_tokens, aborts in every phase, logprobs against transformers."""
from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from tandem import SamplingParams
from tests.conftest import check_idle_engine
from tests.reference import assert_equal_or_near_tie, hf_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _prefill_tokens(client) -> int:
    return client.stats().prefill_tokens


def test_shared_prefix_prefills_only_the_suffix_and_matches_cache_off(tiny_model, launch_client) -> None:
    model = tiny_model("llama")
    rng = random.Random(5)
    system = [rng.randrange(3, 1000) for _ in range(200)]
    a, b = system + [7, 8, 9], system + [11, 12, 13, 14]
    params = SamplingParams(max_tokens=16, **GREEDY)
    on = launch_client(model, debug_integrity=True)
    first = on.generate(a, params).token_ids
    before = _prefill_tokens(on)
    second = on.generate(b, params).token_ids
    assert _prefill_tokens(on) - before == len(b) - len(system)
    check_idle_engine(on)
    off = launch_client(model, prefix_cache=False)
    assert off.generate(a, params).token_ids == first
    before = _prefill_tokens(off)
    assert off.generate(b, params).token_ids == second
    assert _prefill_tokens(off) - before == len(b)
    check_idle_engine(off)


@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_pressure_200_requests_retract_and_match_unconstrained(
    tiny_model, launch_client, page_size
) -> None:
    model = tiny_model("qwen2")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 64))] for _ in range(200)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    need = sum(len(p) + 24 for p in prompts)
    free = launch_client(model, kv_cache_tokens=need + 1024, max_running_requests=256, page_size=page_size)
    want = [c.token_ids for c in free.generate_batch(prompts, params, progress=False)]
    pool = need // 8
    tight = launch_client(model, kv_cache_tokens=pool, max_running_requests=256, page_size=page_size,
                          debug_integrity=True)
    outs = tight.generate_batch(prompts, params, progress=False)
    st = tight.stats()
    assert st.retractions > 0, "the pool was meant to force retractions"
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)
    for p, o, w in zip(prompts, outs, want):
        assert_equal_or_near_tie(model, p, o.token_ids, w)
    assert st.requests_finished == 200 and st.requests_failed == 0
    check_idle_engine(tight)


def _token_texts(tok, ids: list[int]) -> list[str]:
    """Text added by each token (empty while a UTF-8 character is incomplete)."""
    out, prev = [], ""
    for i in range(len(ids)):
        cur = tok.decode(ids[: i + 1])
        cur = cur if not cur.endswith("\ufffd") else prev
        out.append(cur[len(prev):])
        prev = cur
    return out


@pytest.fixture(scope="module")
def qwen3_engine(tiny_model, request):
    from tandem import Client

    model = tiny_model("qwen3")
    client = Client.launch(str(model), dtype="float32", kv_cache_tokens=8192, debug_integrity=True)
    request.addfinalizer(client.close)
    return model, client


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(qwen3_engine, include: bool) -> None:
    model, client = qwen3_engine
    tok = AutoTokenizer.from_pretrained(str(model))
    prompt = [21, 22, 23, 24]
    full = client.generate(prompt, SamplingParams(max_tokens=40, **GREEDY))
    texts = _token_texts(tok, full.token_ids)
    # A stop string made of the end of one token's text and the start of the next one's.
    k = next(i for i in range(3, 39) if len(texts[i]) >= 2 and len(texts[i + 1]) >= 2
             and "\ufffd" not in texts[i] + texts[i + 1])
    stop = texts[k][-2:] + texts[k + 1][:2]
    out = client.generate(
        prompt, SamplingParams(max_tokens=40, stop=[stop], include_stop_str_in_output=include, **GREEDY)
    )
    cut = full.text.index(stop)
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert out.text == full.text[: cut + (len(stop) if include else 0)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
    check_idle_engine(client)


def test_stop_string_in_cjk(qwen3_engine) -> None:
    model, client = qwen3_engine
    for prompt in ["你好，世界", "今天天气很好", "我们一起去", "写一首诗", "人工智能", "长城很长"]:
        full = client.generate(prompt, SamplingParams(max_tokens=64, **GREEDY))
        runs = [m for m in re.findall(r"[\u4e00-\u9fff]{2,}", full.text)]
        if runs:
            break
    else:
        raise AssertionError("no CJK text in any greedy output to build the test from")
    stop = runs[0][:2]
    streamed = list(client.stream(prompt, SamplingParams(max_tokens=64, stop=[stop], **GREEDY)))
    text = "".join(d.text for d in streamed)
    assert streamed[-1].finish_reason == "stop"
    assert text == full.text[: full.text.index(stop)]
    assert stop not in text


def test_min_tokens_holds_back_eos(tiny_model, tmp_path, launch_client) -> None:
    src = tiny_model("llama")
    prompt = [31, 32, 33]
    probe = launch_client(src)
    greedy = probe.generate(prompt, SamplingParams(max_tokens=12, **GREEDY)).token_ids
    # Make the token greedy decoding produces 4th this model's EOS, in a copy of the model.
    eos = greedy[3]
    model = tmp_path / "eos-model"
    shutil.copytree(src, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (model / "generation_config.json").write_text(json.dumps(gen))
    client = launch_client(model)
    plain = client.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    assert plain.finish_reason == "stop" and plain.matched_stop == eos
    assert plain.token_ids == greedy[: greedy.index(eos) + 1]
    held = client.generate(prompt, SamplingParams(max_tokens=12, min_tokens=8, temperature=0.0))
    assert len(held.token_ids) >= 8 and eos not in held.token_ids[:8]
    assert held.finish_reason == "length" or held.token_ids[-1] == eos
    check_idle_engine(client)


def test_abort_while_queued_prefilling_and_decoding(tiny_model, launch_client) -> None:
    import asyncio

    from tandem import AsyncClient

    engine = launch_client(tiny_model("llama"), max_running_requests=1, max_num_batched_tokens=16,
                           debug_integrity=True)

    async def collect(c: AsyncClient, prompt, rid: str, first: asyncio.Event | None = None,
                      max_tokens: int = 1500) -> list:
        out = []
        async for d in c.stream(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), request_id=rid):
            out.append(d)
            if first is not None:
                first.set()
        return out

    async def scenario() -> dict[str, list]:
        async with AsyncClient(engine.endpoint) as c:
            started = asyncio.Event()
            decoding = asyncio.create_task(collect(c, [1, 2, 3], "decoding", started))
            await started.wait()
            # One request runs at a time: this one waits in the queue.
            queued = asyncio.create_task(collect(c, [4, 5, 6], "queued"))
            while (await c.stats()).waiting < 1:
                await asyncio.sleep(0.01)
            await c.abort("queued")
            q = await queued
            await c.abort("decoding")
            d = await decoding
            # A 1,800-token prompt prefills 16 tokens a step: abort it in the middle.
            base = (await c.stats()).prefill_tokens
            prefill = asyncio.create_task(
                collect(c, [3 + i % 1000 for i in range(1800)], "prefilling", max_tokens=100)
            )
            while (await c.stats()).prefill_tokens - base < 64 and not prefill.done():
                await asyncio.sleep(0.01)
            await c.abort("prefilling")
            p = await prefill
            assert (await c.stats()).prefill_tokens - base < 1800
            return {"queued": q, "decoding": d, "prefilling": p}

    ends = asyncio.run(scenario())
    for rid, deltas in ends.items():
        done = [x for x in deltas if x.finished]
        assert len(done) == 1 and done[0].finish_reason == "abort", (rid, deltas[-1:])
    assert sum(len(x.token_ids) for x in ends["queued"]) == 0
    assert sum(len(x.token_ids) for x in ends["prefilling"]) == 0
    assert 0 < sum(len(x.token_ids) for x in ends["decoding"]) < 1500
    check_idle_engine(engine)


def test_logprobs_and_prompt_logprobs_match_transformers(qwen3_engine) -> None:
    model, client = qwen3_engine
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    out = client.generate(prompt, SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, **GREEDY))
    seq = prompt + out.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(model)(input_ids=torch.tensor([seq])).logits[0].float(), -1)
    lp, plp = out.logprobs, out.prompt_logprobs
    assert lp is not None and plp is not None
    assert lp.token_ids == out.token_ids and len(lp.top_ids[0]) == 3
    for i, t in enumerate(out.token_ids):
        pos = len(prompt) - 1 + i
        assert abs(lp.logprobs[i] - float(ref[pos, t])) < 1e-4
        top = torch.topk(ref[pos], 3)
        assert lp.top_ids[i] == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs[i], top.values.tolist())) < 1e-4
    assert plp.token_ids == prompt[1:]
    for j, t in enumerate(prompt[1:]):
        assert abs(plp.logprobs[j] - float(ref[j, t])) < 1e-4
        assert plp.top_ids[j] == torch.topk(ref[j], 2).indices.tolist()

"""Embeddings through a launched engine and the Python client: mixed with generations under KV pressure,
bad inputs as typed errors while the engine serves on, and a Matryoshka model's `dimensions`."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from tandem import AsyncClient, Embedding, InvalidRequestError
from tandem.protocol.errors import ErrorCode
from tests.conftest import check_idle_engine

GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _vec(e: Embedding) -> torch.Tensor:
    return torch.tensor(e.embedding)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from tandem import Client

    # A pool of 320 slots for up to 32 running requests of up to ~100 tokens: the cache is evicted, and
    # generations growing beside admitted prompts retract others (as arrivals fall).
    c = Client.launch(str(tiny_model("llama")), dtype="float32", kv_cache_tokens=320, max_running_requests=32,
                      chunked_prefill_tokens=64, pooling="mean", max_model_len=256)
    yield c
    c.close()


def test_64_embeddings_mixed_with_16_generations(engine) -> None:
    embeds = [_ids(8 + (7 * i) % 90, i) for i in range(64)]
    gens = [_ids(10 + i, 1000 + i) for i in range(16)]
    alone_gen = engine.generate_batch(gens, GREEDY, progress=False)
    alone_emb = engine.embed_batch(embeds[:8])

    async def mixed() -> list:
        async with AsyncClient(engine.endpoint) as ac:
            calls = []
            for i in range(80):  # every fifth a generation, submitted all at once
                calls.append(
                    ac.generate(gens[i // 5], GREEDY) if i % 5 == 4 else ac.embed(embeds[i - i // 5])
                )
            return await asyncio.gather(*calls)

    results = asyncio.run(mixed())
    out_gen = [r for i, r in enumerate(results) if i % 5 == 4]
    out_emb = [r for i, r in enumerate(results) if i % 5 != 4]
    assert [g.token_ids for g in out_gen] == [g.token_ids for g in alone_gen]
    assert all(e.finish_reason == "stop" and e.prompt_tokens == len(p) for e, p in zip(out_emb, embeds))
    for a, b in zip(alone_emb, out_emb[:8]):
        torch.testing.assert_close(_vec(b), _vec(a), atol=1e-5, rtol=0)
    assert all(e.dimensions == 64 for e in out_emb)
    check_idle_engine(engine)  # every request ended, KV back to free + evictable cache


@pytest.mark.parametrize(("kwargs", "code"), [
    ({"input": ""}, ErrorCode.EMPTY_PROMPT),
    ({"input": []}, ErrorCode.EMPTY_PROMPT),
    ({"input": [5] * 257}, ErrorCode.PROMPT_TOO_LONG),
    ({"input": [5, 4096]}, ErrorCode.TOKEN_ID),
    ({"input": "abc", "dimensions": 16}, ErrorCode.DIMENSIONS),  # not a Matryoshka model
    ({"input": "abc", "dimensions": 0}, ErrorCode.PARAMS),
])
def test_bad_input_is_a_typed_error_and_the_engine_serves_on(engine, kwargs: dict, code: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        engine.embed(**kwargs)
    assert e.value.code == code
    full = engine.embed([5] * 256)  # the context full: no room for an output needed
    assert full.prompt_tokens == 256 and full.dimensions == 64
    check_idle_engine(engine)


def test_wrong_input_type_and_a_cancelled_call(engine) -> None:
    with pytest.raises(InvalidRequestError):
        engine.embed({"text": "x"})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        engine.embed_batch("one string")  # type: ignore[arg-type]

    async def cancelled() -> None:
        async with AsyncClient(engine.endpoint) as ac:
            task = asyncio.ensure_future(ac.embed(_ids(200, 7)))
            await asyncio.sleep(0.01)
            task.cancel()  # aborts it in the engine, whether it had started or not
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(cancelled())
    check_idle_engine(engine)


def test_matryoshka_model_takes_dimensions(tiny_model, tmp_path, launch_client) -> None:
    model = tmp_path / "matryoshka"
    shutil.copytree(tiny_model("llama"), model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    c = launch_client(model, pooling="last")
    raw = _vec(c.embed("The river runs", normalize=False))
    for d in (16, 32, 64):  # 64: the full size, always allowed
        e = c.embed("The river runs", dimensions=d)
        assert e.dimensions == d
        torch.testing.assert_close(_vec(e), torch.nn.functional.normalize(raw[:d], dim=0), atol=1e-6, rtol=0)
    with pytest.raises(InvalidRequestError) as err:
        c.embed("The river runs", dimensions=20)
    assert err.value.code == ErrorCode.DIMENSIONS and "[16, 32]" in err.value.message
    check_idle_engine(c)

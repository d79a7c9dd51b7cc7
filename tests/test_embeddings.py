"""Embeddings, scheduler and worker in one process: the pooled final hidden states equal transformers' pooled
the same way (float32, 1e-5; Gemma 3 past its sliding window), whole or chunked, batched with generations,
after prefix-cache hits, cut to a Matryoshka prefix; the requests end once with their KV back."""
from __future__ import annotations

from array import array
from pathlib import Path

import pytest
import torch

from tandem import EmbedParams, SamplingParams
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import EmbeddingBatch, EmbeddingOutput, TokenBatch, TokenizedRequest
from tandem.protocol.model_info import read_model_info
from tandem.scheduler.scheduler import Scheduler
from tandem.worker.model_runner import ModelRunner
from tests.reference import hf_model

ATOL = 1e-5
# Lengths that cross the 5-token chunks unevenly; 1 is a prompt that is its own last token.
LENGTHS = (1, 5, 13, 37)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model_dir: Path, ids: list[int], pooling: str, dims: int | None = None,
              normalize: bool = True) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), pooled, cut and normalized."""
    with torch.no_grad():
        h = hf_model(model_dir).model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    v = v[:dims] if dims else v
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def vector(out: EmbeddingOutput) -> torch.Tensor:
    a = array("f")
    a.frombytes(out.embedding)
    return torch.tensor(a.tolist())


class Engine:
    """Scheduler + ModelRunner driven step by step; run() returns every request's answer."""

    def __init__(self, model_dir: Path, pooling: str, **opts: object) -> None:
        kw = {"kv_cache_tokens": 2048, "max_running_requests": 16, "device": "cpu", "dtype": "float32",
              "chunked_prefill_tokens": 5, "pooling": pooling, **opts}
        self.cfg = EngineConfig(model=str(model_dir), **kw)  # type: ignore[arg-type]
        self.info = read_model_info(model_dir)
        self.runner = ModelRunner(self.cfg, self.info)
        self.sched = Scheduler(self.cfg, self.info, self.runner.num_kv_slots, self.runner.num_host_slots,
                               self.runner.num_swa_slots)

    def run(
        self, reqs: list[TokenizedRequest], also: list[str] = ()
    ) -> dict[str, EmbeddingOutput | list[int]]:  # type: ignore[assignment]
        """also: requests added before that end now."""
        for r in reqs:
            self.sched.add_request(r)
        out: dict[str, EmbeddingOutput | list[int]] = {}
        ended: list[str] = []
        while self.sched.has_work:
            so = self.sched.schedule()
            assert so is not None, "nothing schedulable while requests wait"
            self.sched.commit(self.runner.execute(so))
            for msg in self.sched.take_outbox():
                if isinstance(msg, EmbeddingBatch):
                    for e in msg.outputs:
                        out[e.rid] = e
                        ended.append(e.rid)
                elif isinstance(msg, TokenBatch):
                    for d in msg.deltas:
                        toks = out.setdefault(d.rid, [])
                        assert isinstance(toks, list)
                        toks += d.token_ids
                        ended += [d.rid] if d.finished else []
        assert sorted(ended) == sorted([r.rid for r in reqs] + list(also)), "every request ends exactly once"
        self.sched.kv.check_idle()  # nothing owned by anyone: KV back to free + evictable cache
        return out


def embed_req(rid: str, ids: list[int], **kw: object) -> TokenizedRequest:
    return TokenizedRequest(rid, ids, SamplingParams(), embed=EmbedParams(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])  # gemma3: past its 16-token window
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_hidden_states_equal_transformers(arch: str, pooling: str, tiny_model) -> None:
    model = tiny_model(arch)
    eng = Engine(model, pooling)
    prompts = {f"e{n}": _prompt(n, n) for n in LENGTHS}
    # Batched with each other and with a generation, each prompt in 5-token chunks.
    gen = TokenizedRequest("g", _prompt(9, 99), SamplingParams(max_tokens=6, temperature=0.0))
    out = eng.run([embed_req(rid, ids) for rid, ids in prompts.items()] + [gen])
    assert len(out["g"]) == 6  # type: ignore[arg-type]
    for rid, ids in prompts.items():
        e = out[rid]
        assert isinstance(e, EmbeddingOutput) and e.finish_reason == "stop" and e.prompt_tokens == len(ids)
        torch.testing.assert_close(vector(e), reference(model, ids, pooling), atol=ATOL, rtol=0)
    # The prompts are in the prefix cache now (and a generation that began with the longest one). Last-token
    # pooling takes the hit and computes the last token only; mean and cls compute every token again.
    longest = prompts[f"e{LENGTHS[-1]}"]
    eng.run([TokenizedRequest("g2", longest + [7, 8], SamplingParams(max_tokens=2, temperature=0.0))])
    again = eng.run([embed_req("again", longest)])["again"]
    assert isinstance(again, EmbeddingOutput)
    assert again.cached_tokens == (len(longest) - 1 if pooling == "last" else 0)
    torch.testing.assert_close(vector(again), reference(model, longest, pooling), atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_hidden_states_on_cuda(pooling: str, tiny_model) -> None:
    """The CPU test's twin on the GPU (triton attention; its float32 dots may round through TF32)."""
    model = tiny_model("qwen3")
    eng = Engine(model, pooling, device="cuda")
    prompts = {f"e{n}": _prompt(n, n) for n in LENGTHS}
    out = eng.run([embed_req(rid, ids) for rid, ids in prompts.items()])
    for rid, ids in prompts.items():
        torch.testing.assert_close(vector(out[rid]), reference(model, ids, pooling), atol=2e-3, rtol=0)  # type: ignore[arg-type]


def test_raw_and_matryoshka_vectors(tiny_model) -> None:
    model = tiny_model("llama")
    ids = _prompt(21, 3)
    eng = Engine(model, "mean")
    # The model is not Matryoshka: the frontend refuses `dimensions` (tests/test_embeddings_engine.py); the
    # worker's cut itself is checked here.
    out = eng.run([embed_req("raw", ids, normalize=False), embed_req("cut", ids, dimensions=16),
                   embed_req("cut-raw", ids, dimensions=16, normalize=False)])
    torch.testing.assert_close(vector(out["raw"]), reference(model, ids, "mean", normalize=False), atol=ATOL,  # type: ignore[arg-type]
                               rtol=0)
    torch.testing.assert_close(vector(out["cut"]), reference(model, ids, "mean", 16), atol=ATOL, rtol=0)  # type: ignore[arg-type]
    assert vector(out["cut"]).norm().item() == pytest.approx(1.0, abs=1e-6)  # type: ignore[arg-type]
    # Chunked differently beside each other, so summed in another order: equal to float32 rounding.
    torch.testing.assert_close(vector(out["cut-raw"]), vector(out["raw"])[:16], atol=1e-6, rtol=0)  # type: ignore[arg-type]


def test_retracted_embedding_pools_its_prompt_again(tiny_model) -> None:
    """A retraction frees the row mid-prompt (its partial pool with it); the request computes its prompt
    again and pools all of it once."""
    model = tiny_model("llama")
    eng = Engine(model, "mean")
    ids = _prompt(23, 5)
    sched = eng.sched
    sched.add_request(embed_req("e", ids))
    sched.commit(eng.runner.execute(sched.schedule()))  # type: ignore[arg-type]
    req = sched.reqs["e"]
    assert req.num_computed_tokens == 5 and req.kv_committed_len == 5
    sched._retract(req)  # what the decode scheduler does to it under KV pressure
    out = eng.run([], also=["e"])
    torch.testing.assert_close(vector(out["e"]), reference(model, ids, "mean"), atol=ATOL, rtol=0)  # type: ignore[arg-type]
    assert eng.sched.stats.retractions == 1


def test_embeddings_wait_in_the_priority_order(tiny_model) -> None:
    eng = Engine(tiny_model("llama"), "last", scheduling_policy="priority", max_running_requests=1)
    done: list[str] = []
    for rid, prio in (("low", 2), ("high", -1), ("mid", 0)):
        eng.sched.add_request(
            TokenizedRequest(rid, _prompt(12, 1), SamplingParams(), prio, embed=EmbedParams())
        )
    while eng.sched.has_work:
        eng.sched.commit(eng.runner.execute(eng.sched.schedule()))  # type: ignore[arg-type]
        done += [e.rid for m in eng.sched.take_outbox() if isinstance(m, EmbeddingBatch) for e in m.outputs]
    assert done == ["high", "mid", "low"]


def test_pooling_option() -> None:
    import argparse

    from tandem.launch.cli_options import add_engine_flags, config_from_args

    ap = argparse.ArgumentParser()
    add_engine_flags(ap)
    assert config_from_args(ap.parse_args(["--model", "m"])).pooling == "last"
    assert config_from_args(ap.parse_args(["--model", "m", "--pooling", "cls"])).pooling == "cls"
    with pytest.raises(ValueError, match="pooling"):
        EngineConfig(model="m", pooling="max")

"""ModelRunner logprobs, prompt logprobs and penalties against transformers on a tiny model (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import Logprobs, NewReqData, ScheduledReq, SchedulerOutput, WorkerSampling
from tandem.protocol.model_info import read_model_info
from tandem.worker.model_runner import ModelRunner

ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:  # conftest factory
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _runner(model_dir: Path) -> ModelRunner:
    cfg = EngineConfig(
        model=str(model_dir), kv_cache_tokens=512, max_running_requests=8, device="cpu", dtype="float32"
    )
    return ModelRunner(cfg, read_model_info(cfg.model))


def _ref_logp(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sampling(**kw: object) -> WorkerSampling:
    return WorkerSampling(**{"temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "seed": None, **kw})


def _check(lp: Logprobs, ref: torch.Tensor, tokens: list[int], top_n: int) -> None:
    """lp over len(tokens) positions; ref [len(tokens), V] reference log-probs at those positions."""
    assert lp.token_ids == tokens
    torch.testing.assert_close(
        torch.tensor(lp.logprobs), ref[torch.arange(len(tokens)), tokens], atol=ATOL, rtol=0
    )
    vals, ids = ref.topk(top_n, dim=-1)
    assert lp.top_ids == ids.tolist()
    torch.testing.assert_close(
        torch.tensor(lp.top_logprobs).view(len(tokens), top_n), vals, atol=ATOL, rtol=0
    )


def test_sampled_logprobs_match_hf(model_dir: Path, hf) -> None:
    runner = _runner(model_dir)
    # row 1: greedy, top-5; row 2: greedy, no logprobs; row 3: sampled with a penalty, top-0 (raw logprobs:
    # the penalty must not show in them).
    reqs = {
        1: (_prompt(9, 1), _sampling(logprobs=5)),
        2: (_prompt(13, 2), _sampling()),
        3: (_prompt(6, 3), _sampling(temperature=1.0, seed=7, logprobs=0, repetition_penalty=1.5)),
    }
    seqs = {r: list(p) for r, (p, _) in reqs.items()}
    new = [NewReqData(r, p, len(p), 0, s) for r, (p, s) in reqs.items()]
    slots = iter(range(1, 512))
    sched = [
        ScheduledReq(r, len(p), 0, [next(slots) for _ in range(len(p) + 4)], True)
        for r, (p, _) in reqs.items()
    ]
    for step in range(4):
        out = runner.execute(SchedulerOutput(step, [], new, sched))
        assert out.logprobs is not None and out.prompt_logprobs is None
        assert len(out.logprobs) == len(out.sampled) == 3 and out.logprobs[1] is None
        for (r, seq), tok, lp in zip(seqs.items(), out.sampled, out.logprobs, strict=True):
            ref = _ref_logp(hf, seq)[-1]
            if r == 1:
                assert tok == int(ref.argmax())  # logprobs leave greedy sampling alone
                _check(lp, ref[None], [tok], 5)
            elif r == 3:
                assert (
                    lp is not None
                    and lp.token_ids == [tok]
                    and lp.top_ids == [[]]
                    and lp.top_logprobs == [[]]
                )
                assert abs(lp.logprobs[0] - float(ref[tok])) < ATOL
            seq.append(tok)
        new, sched = [], [ScheduledReq(r, 1, 0, [], True) for r in reqs]


def test_no_logprobs_field_when_nobody_asks(model_dir: Path) -> None:
    runner = _runner(model_dir)
    p = _prompt(5, 4)
    out = runner.execute(
        SchedulerOutput(
            0, [], [NewReqData(1, p, 5, 0, _sampling())], [ScheduledReq(1, 5, 0, list(range(1, 9)), True)]
        )
    )
    assert out.logprobs is None and out.prompt_logprobs is None and len(out.sampled) == 1


@pytest.mark.parametrize("chunks", [[20], [7, 7, 6]], ids=["one-step", "three-chunks"])
def test_prompt_logprobs_match_hf(model_dir: Path, hf, chunks: list[int]) -> None:
    runner = _runner(model_dir)
    prompt, other, third = _prompt(20, 5), _prompt(11, 6), _prompt(4, 7)
    ref = _ref_logp(hf, prompt)
    new = [
        NewReqData(2, prompt, len(prompt), 0, _sampling(prompt_logprobs=3, logprobs=2)),
        NewReqData(5, other, len(other), 0, _sampling(prompt_logprobs=0)),
        NewReqData(6, third, len(third), 0, _sampling()),
    ]
    # In the first step, prefills that sample before (with top-0 prompt logprobs) and after (with none)
    # the chunked request: each one's logits must stay its own.
    first = [
        ScheduledReq(5, len(other), 0, list(range(100, 112)), True),
        None,
        ScheduledReq(6, len(third), 0, list(range(200, 205)), True),
    ]
    got = Logprobs()
    start = 0
    for step, n in enumerate(chunks):
        last = start + n == len(prompt)
        mine = ScheduledReq(2, n, start, list(range(1 + start, 1 + start + n)), last)
        sched = [mine] if step else [s or mine for s in first]
        out = runner.execute(SchedulerOutput(step, [], new, sched))
        new = []
        sampled = dict(zip([s.req_pool_idx for s in sched if s.sample], out.sampled, strict=True))
        assert out.prompt_logprobs is not None and set(out.prompt_logprobs) == ({2} if step else {2, 5})
        part = out.prompt_logprobs[2]
        # positions start .. start+n-1 predict tokens start+1 .. start+n, those < len(prompt)
        assert len(part.token_ids) == min(start + n, len(prompt) - 1) - start
        got.extend(part)
        if step == 0:
            ref_other = _ref_logp(hf, other)
            _check(out.prompt_logprobs[5], ref_other[:-1], other[1:], 0)
            assert sampled[5] == int(ref_other[-1].argmax())
            assert sampled[6] == int(_ref_logp(hf, third)[-1].argmax())
        if last:
            assert sampled[2] == int(ref[-1].argmax())
            assert out.logprobs is not None and out.logprobs[list(sampled).index(2)] is not None
            _check(out.logprobs[list(sampled).index(2)], ref[-1:], [sampled[2]], 2)
        start += n
    _check(got, ref[:-1], prompt[1:], 3)


def _penalised(logits: torch.Tensor, prompt: list[int], outs: list[int], rp: float, pres: float, freq: float):
    x = logits.clone()
    for t in set(prompt) | set(outs):
        x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    for t in set(outs):
        x[t] -= freq * outs.count(t) + pres
    return x


def test_greedy_with_penalties_matches_reference(model_dir: Path, hf) -> None:
    runner = _runner(model_dir)
    prompt = _prompt(8, 8)
    rp, pres, freq = 1.8, 0.5, 0.7
    s = _sampling(repetition_penalty=rp, presence_penalty=pres, frequency_penalty=freq)
    new = [NewReqData(3, prompt, len(prompt), 0, s)]
    sched = [ScheduledReq(3, len(prompt), 0, list(range(1, 30)), True)]
    outs: list[int] = []
    changed = 0
    for step in range(8):
        tok = runner.execute(SchedulerOutput(step, [], new, sched)).sampled[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + outs])).logits[0, -1].float()  # raw: rp is not shift-invariant
        assert tok == int(_penalised(logits, prompt, outs, rp, pres, freq).argmax())
        changed += tok != int(logits.argmax())
        outs.append(tok)
        new, sched = [], [ScheduledReq(3, 1, 0, [], True)]
    assert changed  # the penalties did change some greedy choice, so the check above means something

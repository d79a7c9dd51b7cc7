"""The grammar compiler's start: built in the background while the engine serves (a constrained request that
arrives first waits for it, nothing else does; an abort meanwhile compiles nothing; a failed start is the
constrained request's typed error and the next one builds it again), and the tokenizer's TokenizerInfo kept on
disk per tokenizer."""
from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import RequestError, TokenBatch, TokenizedRequest
from tandem.protocol.model_info import read_model_info
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.grammar import GrammarCompilerService, GrammarSpec, allocate_bitmask
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.structured import start_compiler
from tandem.scheduler.tokenizer_info_cache import cache_path
from tests.fake_worker import FakeWorker

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(d))
    return d


def _service(model: Path) -> GrammarCompilerService:
    return GrammarCompilerService(str(model), read_model_info(model).vocab_size, any_whitespace=False)


def _mask_after(svc: GrammarCompilerService, tokens: list[int]) -> torch.Tensor:
    m = svc.matcher(svc.compile(GrammarSpec("json_schema", '{"type": "object"}')))
    assert all(m.accept(t) for t in tokens)
    mask = allocate_bitmask(1, svc.vocab_size)
    m.fill_bitmask(mask, 0)
    return mask


def test_tokenizer_info_is_kept_on_disk_per_tokenizer(tiny_model, cache_dir: Path, tmp_path: Path) -> None:
    model = tiny_model("llama")
    first = _service(model)
    first.compiler  # noqa: B018 - loads it
    assert not first.info_from_cache and len(list(cache_dir.glob("xgrammar/*.json"))) == 1
    second = _service(model)
    second.compiler  # noqa: B018
    assert second.info_from_cache and second._tokenizer is None  # no tokenizer loaded at all
    a, b = first.tokenizer_info, second.tokenizer_info
    assert (a.decoded_vocab, a.stop_token_ids, a.vocab_type) == (
        b.decoded_vocab,
        b.stop_token_ids,
        b.vocab_type,
    )
    opening = first._tokenizer.encode('{"', add_special_tokens=False)
    assert torch.equal(_mask_after(first, opening), _mask_after(second, opening))
    # Any change to the tokenizer's files is another key (here: another EOS token); a broken file is built
    # again.
    other = tmp_path / "other"
    other.mkdir()
    for f in model.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tok = (
        (other / "tokenizer_config.json")
        .read_text()
        .replace('"eos_token": "<|endoftext|>"', '"eos_token": "<|im_end|>"')
    )
    assert tok != (model / "tokenizer_config.json").read_text()
    (other / "tokenizer_config.json").write_text(tok)
    vocab = read_model_info(model).vocab_size
    assert cache_path(other, vocab, first.stop_token_ids) != cache_path(model, vocab, first.stop_token_ids)
    path = cache_path(model, vocab, first.stop_token_ids)
    assert path is not None
    path.write_text('{"truncated')
    third = _service(model)
    third.compiler  # noqa: B018
    assert not third.info_from_cache and third.tokenizer_info.decoded_vocab == a.decoded_vocab
    assert _service(model).tokenizer_info.decoded_vocab == a.decoded_vocab  # rewritten whole


def test_start_compiler_builds_it_in_the_background(tiny_model, cache_dir: Path) -> None:
    model = tiny_model("llama")
    svc = start_compiler(str(model), read_model_info(model).vocab_size).result(timeout=120)
    assert svc._compiler is not None and svc.num_compiled == 0  # loaded, nothing compiled yet
    svc.shutdown()


def _sched(model: Path, starting: Future) -> Scheduler:
    s = Scheduler(EngineConfig(model=str(model)), read_model_info(model), 1024)
    s.structured.adopt(starting)
    return s


def _ends(s: Scheduler) -> dict[str, str]:
    out: dict[str, str] = {}
    for msg in s.take_outbox():
        if isinstance(msg, RequestError):
            out[msg.rid] = msg.code
        elif isinstance(msg, TokenBatch):
            out.update({d.rid: d.finish_reason for d in msg.deltas if d.finish_reason})
    return out


def _constrained(rid: str) -> TokenizedRequest:
    return TokenizedRequest(rid, [5, 6, 7], SamplingParams(max_tokens=8, json_schema=SCHEMA))


def test_only_a_constrained_request_waits_for_the_start(tiny_model, cache_dir: Path) -> None:
    model = tiny_model("llama")
    starting: Future = Future()  # the background start, still loading
    s = _sched(model, starting)
    s.add_request(_constrained("c"))
    s.add_request(TokenizedRequest("f", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0)))
    worker, ended = FakeWorker(1024), {}
    while "f" not in ended:
        s.admit_compiled()
        so = s.schedule()
        assert so is not None
        s.commit(worker.execute(so))
        ended |= _ends(s)
    assert ended == {"f": "length"} and "c" in s.structured.compiling and not s.waiting
    svc = _service(model)
    starting.set_result(svc)  # loaded: c's compilation goes to it now
    s.structured.compiling["c"][1].result(timeout=60)
    s.admit_compiled()
    assert list(s.waiting) == [s.reqs["c"]] and s.reqs["c"].grammar is not None and svc.num_compiled == 1
    svc.shutdown()


def test_abort_while_starting_compiles_nothing(tiny_model, cache_dir: Path) -> None:
    model = tiny_model("llama")
    starting: Future = Future()
    s = _sched(model, starting)
    s.add_request(_constrained("c"))
    s.abort("c")
    assert _ends(s) == {"c": "abort"} and not s.structured.compiling
    svc = _service(model)
    starting.set_result(svc)
    svc._pool.submit(lambda: None).result(timeout=30)
    assert svc.num_compiled == 0
    s.check_integrity()
    svc.shutdown()


def test_a_failed_start_fails_the_waiting_request_and_the_next_one_builds_it(
    tiny_model, cache_dir: Path
) -> None:
    model = tiny_model("llama")
    starting: Future = Future()
    s = _sched(model, starting)
    s.add_request(_constrained("c1"))
    starting.set_exception(RuntimeError("xgrammar would not load"))
    s.structured.compiling["c1"][1].exception(timeout=30)
    s.admit_compiled()
    assert _ends(s) == {"c1": "internal_error.grammar"}
    s.add_request(_constrained("c2"))
    s.structured.compiling["c2"][1].result(timeout=60)
    s.admit_compiled()
    assert [r.rid for r in s.waiting] == ["c2"]
    s.structured.compiler().shutdown()

"""Stop strings decided once, by the scheduler, and cut by the detokenizer where it says: a scripted
output runs through the real Scheduler (against the fake worker) and the real Detokenizer, and text,
token ids, finish reason and matched stop must describe the same event as a brute-force reference
(the whole output decoded at every token)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.detokenizer.process import Detokenizer
from tandem.detokenizer.stop_holdback import StopHoldBack
from tandem.protocol.engine_config import EngineConfig
from tandem.protocol.messages import DetokRegister, TokenBatch, TokenizedRequest
from tandem.protocol.model_info import ModelInfo
from tandem.protocol.sampling_params import SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tests.fake_worker import FakeWorker
from tests.test_detokenizer import SENTENCES
from tests.test_detokenizer import tokenizer as byte_level_tokenizer

REPLACEMENT = "\ufffd"


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece-style: "▁" marks a word's leading space, dropped when the text starts with it."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    return tok


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, tok in (("bytes", byte_level_tokenizer()), ("metaspace", metaspace_tokenizer())):
        d = tmp_path_factory.mktemp(name)
        tok.save(str(d / "tokenizer.json"))
        (d / "config.json").write_text("{}")  # what makes a directory a model for the tokenizer loader
        dirs[name] = d
    return dirs


def run_scripted(model_dir: Path, prompt: list[int], script: list[int], params: SamplingParams,
                 depth: int = 2) -> tuple[str, list[int], str | None, object]:
    """The engine's path for one request whose sampled tokens are `script`."""
    cfg = EngineConfig(model=str(model_dir), async_scheduling=depth == 2)
    info = ModelInfo(vocab_size=1 << 16, max_model_len=512, eos_token_ids=[], architecture="fake")
    sched = Scheduler(cfg, info, 1024)
    # Past the script: an overrun step of a request that already ended (dropped by the scheduler).
    worker = FakeWorker(1024, lambda prev, pos: script[min(pos - len(prompt), len(script) - 1)])
    detok = Detokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    sched.add_request(TokenizedRequest("r", prompt, params))
    text, ids, finish, matched, queue = "", [], None, None, []
    while sched.has_work or sched.inflight:
        while sched.has_work and len(sched.inflight) < depth and (so := sched.schedule()) is not None:
            queue.append(worker.execute(so))
        sched.commit(queue.pop(0))
        for msg in sched.take_outbox():
            if isinstance(msg, DetokRegister):
                detok.register(msg)
            elif isinstance(msg, TokenBatch):
                for out in detok.process(msg).outputs:
                    assert finish is None, "output after the finish"
                    text, ids = text + out.text, ids + out.token_ids
                    finish, matched = out.finish_reason, out.matched_stop
    return text, ids, finish, matched


def reference(tok: Tokenizer, prompt: list[int], script: list[int], stops: list[str], min_tokens: int,
              include: bool) -> tuple[str, list[int], str, object]:
    """Decode prompt + output whole at every token: the first stop string completed by a token at or
    past min_tokens (earliest-ending, then longest) ends it."""
    skip = len(tok.decode(prompt))
    before = ""
    for k in range(1, len(script) + 1):
        text = tok.decode(prompt + script[:k])[skip:]
        if k >= min_tokens:
            hits = []
            for s in stops:
                i = text.find(s, max(0, len(before.rstrip(REPLACEMENT)) - len(s) + 1))
                if i >= 0:
                    hits.append((i + len(s), -len(s), i, s))
            if hits:
                end, _, i, s = min(hits)
                return text[: end if include else i], script[:k], "stop", s
        before = text
    return tok.decode(prompt + script)[skip:], script, "length", None


@pytest.mark.parametrize("depth", [1, 2])
def test_period_stop_respects_min_tokens(model_dirs: dict[str, Path], depth: int) -> None:
    tok = Tokenizer.from_file(str(model_dirs["bytes"] / "tokenizer.json"))
    prompt = tok.encode("Say:").ids
    script = tok.encode("A b. C d. E f g h i j k l m n o p q r s. t u. v").ids
    first_period_past_20 = next(k for k in range(20, len(script) + 1) if "." in tok.decode(script[k - 1 : k]))
    params = SamplingParams(max_tokens=len(script), stop=["."], min_tokens=20)
    text, ids, finish, matched = run_scripted(model_dirs["bytes"], prompt, script, params, depth)
    assert (finish, matched) == ("stop", ".")
    assert ids == script[:first_period_past_20]
    assert text == tok.decode(ids)[: tok.decode(ids).rindex(".")]  # cut at that period, earlier ones kept
    assert text.count(".") == 2
    assert (text, ids, finish, matched) == reference(tok, prompt, script, ["."], 20, False)


@pytest.mark.parametrize("include", [False, True])
def test_leading_space_stop_on_sentencepiece(model_dirs: dict[str, Path], include: bool) -> None:
    """The first output token is "▁fox": alone it decodes as "fox", after the prompt as " fox"."""
    tok = Tokenizer.from_file(str(model_dirs["metaspace"] / "tokenizer.json"))
    prompt = tok.encode("The quick brown").ids
    script = tok.encode("fox jumps over").ids
    assert tok.id_to_token(script[0]).startswith("▁") and not tok.decode(script[:1]).startswith(" ")
    params = SamplingParams(max_tokens=len(script), stop=[" fox"], include_stop_str_in_output=include)
    text, ids, finish, matched = run_scripted(model_dirs["metaspace"], prompt, script, params)
    assert (finish, matched) == ("stop", " fox")
    assert ids == script[: len(tok.encode("fox").ids)]
    assert text == (" fox" if include else "")
    # A stop in the middle keeps the text before it, leading space included.
    params = SamplingParams(max_tokens=len(script), stop=[" over"], include_stop_str_in_output=include)
    text, _, finish, _ = run_scripted(model_dirs["metaspace"], prompt, script, params)
    assert finish == "stop" and text == (" fox jumps over" if include else " fox jumps")


ALPHABET = "ab .中😀"


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["bytes", "metaspace"]),
    words=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=8),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3),
    min_tokens=st.integers(0, 6),
    include=st.booleans(),
    depth=st.sampled_from([1, 2]),
)
def test_matches_whole_text_reference(model_dirs: dict[str, Path], kind: str, words: list[str],
                                      stops: list[str], min_tokens: int, include: bool, depth: int) -> None:
    tok = Tokenizer.from_file(str(model_dirs[kind] / "tokenizer.json"))
    prompt = tok.encode("go").ids
    script = tok.encode(" ".join(words)).ids
    if kind == "metaspace" and tok.token_to_id("<unk>") in script:
        return  # a character this tiny vocab lacks: not text the engine could produce
    params = SamplingParams(max_tokens=len(script), stop=stops, min_tokens=min(min_tokens, len(script)),
                            include_stop_str_in_output=include, skip_special_tokens=False)
    got = run_scripted(model_dirs[kind], prompt, script, params, depth)
    assert got == reference(tok, prompt, script, stops, params.min_tokens, include)


def test_holdback_releases_what_cannot_start_a_stop() -> None:
    h = StopHoldBack(["结束吧", "aab"])
    assert h.feed("text 结") == "text "
    assert h.feed("束") == ""
    assert h.feed("!xaa") == "结束!x"  # "aa" may still start "aab"
    assert h.finish("b", 3) == ""  # the scheduler's stop "aab" cut: nothing of it was streamed

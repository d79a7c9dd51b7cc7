"""Think markers that are single tokens, as in Qwen3's vocabulary (`<think>` 151667 and `</think>` 151668,
added tokens with `special: false`, so decoding keeps them): the made models' BPE cuts each marker into
several tokens, which is all the other reasoning tests see. Here the scripted engine emits token ids, the
engine's detokenizer turns them into text, and chat completions, the Responses API and the Messages API
must each split reasoning from content as the reasoning parser does for the same text, streamed == whole,
no marker ever in the output."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer

from tandem.frontend.reasoning_parser import CLOSE, OPEN
from tandem.launch.tokenizer_maker import QWEN3_CHAT_TEMPLATE
from tandem.protocol.tokenizer_loader import load_tokenizer
from tests.scripted_engine import KEY, NAME, Reply, scripted_app, transport
from tests.wire_schema import sse_events

REASONING, CONTENT = "The user says hi.\nI answer: 2 < 3.", "Hello there! 👋"
AUTH = {"authorization": f"Bearer {KEY}", "x-api-key": KEY}
# Qwen3's thinking-only models open the think block in the prompt; a template kwarg stands for that here.
OPENING_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(
    "{% endif %}{% endif %}", "{% elif opened is defined and opened %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def think_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny qwen3 with `<think>` and `</think>` added as Qwen3's tokenizer.json has them."""
    src, out = tiny_model("qwen3"), tmp_path_factory.mktemp("qwen3-think-tokens")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_tokens([AddedToken(m, single_word=False, lstrip=False, rstrip=False, normalized=False, special=False)
                    for m in (OPEN, CLOSE)])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = OPENING_TEMPLATE
    cfg["added_tokens_decoder"] = {
        str(tok.token_to_id(m)): {"content": m, "single_word": False, "lstrip": False, "rstrip": False,
                                  "normalized": False, "special": False} for m in (OPEN, CLOSE)}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = json.loads((src / "config.json").read_text())
    hf["vocab_size"] = tok.get_vocab_size()  # the two new ids inside the model's vocabulary
    (out / "config.json").write_text(json.dumps(hf))
    return out


@pytest.fixture(scope="module")
def ids(think_model) -> dict[str, Any]:
    tok = load_tokenizer(think_model)
    marks = {m: tok.convert_tokens_to_ids(m) for m in (OPEN, CLOSE)}
    for m, i in marks.items():  # one token each, kept by a decode that skips special tokens
        assert tok.encode(m, add_special_tokens=False) == [i] and i >= 1024, m
        assert tok.decode([i], skip_special_tokens=True) == m
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert marks[OPEN] in enc(f"x{OPEN}\nR{CLOSE}\n\nC") and marks[CLOSE] in enc(f"R{CLOSE}")
    return {"open": marks[OPEN], "close": marks[CLOSE], "enc": enc}


def _chunks(seq: list[int], how: str) -> list[list[int]]:
    if how == "whole":
        return [seq]
    step = int(how)
    return [seq[i:i + step] for i in range(0, len(seq), step)]


async def _both(app, engine, path: str, body: dict, reply: list[list[int]], finish: str = "stop") -> tuple:
    """The route's whole answer and its streamed events, each for the same scripted tokens."""
    async with transport(app) as http:
        engine.script(Reply(reply, finish))
        whole = await http.post(path, json=body, headers=AUTH)
        engine.script(Reply(reply, finish))
        streamed = await http.post(path, json={**body, "stream": True}, headers=AUTH)
    assert whole.status_code == streamed.status_code == 200, (whole.text, streamed.text)
    return whole.json(), [e for _, e in sse_events(streamed.text)]


def _chat(app, engine, reply: list[list[int]], finish: str = "stop", markers_in_content: bool = False,
          **kw: Any) -> tuple[tuple, tuple]:
    """(reasoning, content) of the whole chat completion, and of its streamed deltas joined."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, **kw}
    whole, events = asyncio.run(_both(app, engine, "/v1/chat/completions", body, reply, finish))
    msg = whole["choices"][0]["message"]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    for d in deltas if not markers_in_content else ():  # no piece of a marker goes out, as tokens come
        assert "<think" not in json.dumps(d) and "</think" not in json.dumps(d), d
    streamed = ("".join(d.get("reasoning_content") or "" for d in deltas) or None,
                "".join(d.get("content") or "" for d in deltas))
    return (msg.get("reasoning_content"), msg["content"]), streamed


@pytest.mark.parametrize("how", ["1", "2", "5", "whole"])
def test_chat_single_token_markers(think_model, ids, how) -> None:
    engine, app = scripted_app(think_model, "qwen3")
    seq = [ids["open"], *ids["enc"](f"\n{REASONING}\n"), ids["close"], *ids["enc"](f"\n\n{CONTENT}")]
    whole, streamed = _chat(app, engine, _chunks(seq, how))
    assert whole == streamed == (REASONING, CONTENT)


def test_markers_alone_in_their_outputs_and_after_the_block(think_model, ids) -> None:
    """Each marker its own engine output; after the block, markers are content as written."""
    engine, app = scripted_app(think_model, "qwen3")
    o, c, enc = ids["open"], ids["close"], ids["enc"]
    whole, streamed = _chat(app, engine, [[o], enc("\nwhy"), [c], enc("\n\nSee "), [o], enc("x"), [c]],
                            markers_in_content=True)
    assert whole == streamed == ("why", f"See {OPEN}x{CLOSE}")


def test_prompt_opened_block_and_cut_off_reasoning(think_model, ids) -> None:
    engine, app = scripted_app(think_model, "qwen3")
    seq = [*ids["enc"](REASONING), ids["close"], *ids["enc"](f"\n\n{CONTENT}")]
    whole, streamed = _chat(app, engine, _chunks(seq, "3"), chat_template_kwargs={"opened": True})
    assert engine.prompts[0][-2:] == [ids["open"], *ids["enc"]("\n")]  # the prompt's marker is one token too
    assert whole == streamed == (REASONING, CONTENT)
    cut = [ids["open"], *ids["enc"]("\nstill thinking ")]
    whole, streamed = _chat(app, engine, _chunks(cut, "1"), "length")
    assert whole == streamed == ("still thinking", "")


def test_responses_and_messages_single_token_markers(think_model, ids) -> None:
    engine, app = scripted_app(think_model, "qwen3")
    seq = _chunks([ids["open"], *ids["enc"](f"\n{REASONING}\n"), ids["close"], *ids["enc"](f"\n\n{CONTENT}")], "2")
    r, events = asyncio.run(_both(app, engine, "/v1/responses", {"model": NAME, "input": "hi"}, seq))
    assert [(o["type"], o["content"][0]["text"]) for o in r["output"]] == [
        ("reasoning", REASONING), ("message", CONTENT)]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == REASONING
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == CONTENT
    assert [o["content"] for o in events[-1]["response"]["output"]] == [o["content"] for o in r["output"]]
    body = {"model": NAME, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    m, events = asyncio.run(_both(app, engine, "/v1/messages", body, seq))
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in m["content"]] == [
        ("thinking", REASONING), ("text", CONTENT)]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == REASONING
    assert "".join(d.get("text", "") for d in deltas) == CONTENT

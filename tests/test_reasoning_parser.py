"""The reasoning parser: reasoning and content of scripted replies, the same however the reply is split
into pieces (streamed == whole), the markers never handed out, and `auto` read from the chat template."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.frontend.reasoning_parser import (
    CLOSE,
    OPEN,
    ReasoningParser,
    check_style,
    opens_reasoning,
    split_reasoning,
    template_style,
)

# (reply, style, prompt opened a think block) -> (reasoning, content)
CASES = [
    ("<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello!", "qwen3", False,
     ("The user greets me.\nI greet back.", "Hello!")),
    ("Just an answer, no thinking.", "qwen3", False, (None, "Just an answer, no thinking.")),
    ("  <thinking> is a tag, not a marker", "qwen3", False, (None, "  <thinking> is a tag, not a marker")),
    ("Hi <think>not at the start</think>", "qwen3", False, (None, "Hi <think>not at the start</think>")),
    ("<think>cut off by max_tokens </thi", "qwen3", False, ("cut off by max_tokens </thi", "")),
    ("<think>\n\n</think>\n\nempty thinking", "qwen3", False, (None, "empty thinking")),
    ("<think>a < b </thinx c</think>x</think>y", "qwen3", False, ("a < b </thinx c", "x</think>y")),
    ("Okay, 2+2=4.\n</think>\n\n**4**", "qwen3", True, ("Okay, 2+2=4.", "**4**")),
    ("Okay, 2+2=4.\n</think>\n\n**4**", "deepseek-r1", False, ("Okay, 2+2=4.", "**4**")),
    ("<think>\nR1 wrote the marker itself</think>answer", "deepseek-r1", False,
     ("R1 wrote the marker itself", "answer")),
    ("never closed, all reasoning", "deepseek-r1", False, ("never closed, all reasoning", "")),
    ("</think>straight to the answer", "deepseek-r1", False, (None, "straight to the answer")),
    ("<think>思考 👋 中</think>\n答え", "qwen3", False, ("思考 👋 中", "答え")),
    ("", "qwen3", False, (None, "")),
    ("", "deepseek-r1", False, (None, "")),
]


@pytest.mark.parametrize(("text", "style", "opened", "want"), CASES)
def test_whole_reply(text: str, style: str, opened: bool, want: tuple[str | None, str]) -> None:
    assert split_reasoning(text, style, opened) == want


def _streamed(text: str, cuts: list[int], style: str, opened: bool) -> tuple[str, str, list]:
    p = ReasoningParser(style, opened)
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    assert "".join(d.reasoning for d in deltas) == p.reasoning
    assert "".join(d.content for d in deltas) == p.content
    return p.reasoning, p.content, deltas


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 80), max_size=30))
def test_any_split_gives_the_whole_reply(case, cuts: list[int]) -> None:
    text, style, opened, want = case
    reasoning, content, deltas = _streamed(text, [c for c in cuts if c <= len(text)], style, opened)
    assert (reasoning or None, content) == want
    if OPEN not in want[1] and CLOSE not in want[1]:  # markers the model meant as markers never go out
        for d in deltas:
            assert OPEN not in d.reasoning + d.content and CLOSE not in d.reasoning + d.content


# An independent reading of the module docstring, over the whole reply at once (regular expressions and
# str.partition, not the parser's char-by-char state machine): the property tests hold the parser to it.
_OPENING = re.compile(r"\s*<think>")  # the opening marker counts only at the start, after whitespace


def reference_split(text: str, style: str, opened: bool) -> tuple[str | None, str]:
    m = _OPENING.match(text)
    if m is not None:
        body = text[m.end():]
    elif style == "deepseek-r1" or opened:  # the reply starts inside the reasoning
        body = text
    else:  # qwen3 without an opening marker: all content, as written
        return None, text
    reasoning, closed, rest = body.partition("</think>")  # one think block: the first closing marker ends it
    return reasoning.strip() or None, rest.lstrip() if closed else ""


# Fragments that make markers, near-markers and the whitespace around them (Unicode's too: str.strip's),
# the markers weighted up so that most replies hold one where it counts.
MARKERS = ["<think>", "</think>", "</think>", "why </think>\n\n", "\n</think>", "so\n</think>"]
FRAGMENTS = [*MARKERS, "<", "</", "/", ">", "<th", "<thi", "</thi", "</think", "think>", "ink>", "<thinking>",
             "</thinking>", "<think >", "<THINK>", " ", "  ", "\n", "\n\n", "\t", "\r\n", "\u3000", "\xa0",
             "\x85", "\u2028", "a", "x y", "é", "思考", "👋", "2 < 3 > 1", "\ufffd"]
HEADS = ["", "<think>", "<think>\n", "\n <think>", "<thi", "<thinking>", " ", "\n\n"]  # how replies open
replies = st.builds(
    lambda head, parts: head + "".join(parts),
    st.sampled_from(HEADS),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=20),
)
styles = st.sampled_from(["qwen3", "deepseek-r1"])


@settings(max_examples=300, deadline=None)
@given(replies, st.lists(st.integers(0, 150), max_size=20), styles, st.booleans())
def test_any_reply_any_split_matches_the_reference(text: str, cuts: list[int], style: str, opened: bool) -> None:
    """Random replies of marker fragments, fed in random pieces: exactly the reference's split."""
    want = reference_split(text, style, opened)
    assert split_reasoning(text, style, opened) == want
    reasoning, content, _ = _streamed(text, [c for c in cuts if c <= len(text)], style, opened)
    assert (reasoning or None, content) == want


@settings(max_examples=200, deadline=None)
@given(replies, styles, st.booleans())
def test_held_back_is_only_whitespace_and_a_marker_start(text: str, style: str, opened: bool) -> None:
    """Fed char by char, what has gone out is the reference's split of the text so far, but for what may
    still turn out to be a marker or the whitespace before one: the parser streams, it does not buffer."""
    p = ReasoningParser(style, opened)
    for i, ch in enumerate(text, 1):
        p.feed(ch)
        so_far = reference_split(text[:i], style, opened)
        for sent, whole in ((p.reasoning, so_far[0] or ""), (p.content, so_far[1])):
            assert whole.startswith(sent), (text[:i], sent, whole)
            assert len(whole[len(sent):].lstrip()) < len("</think>"), (text[:i], sent, whole)


def test_streamed_reasoning_goes_out_as_it_comes() -> None:
    p = ReasoningParser("qwen3")
    assert p.feed("<thi").reasoning == ""  # may still be the marker
    assert p.feed("nk>\nStep one").reasoning == "Step one"
    # " </th" waits: it may be the marker, and the whitespace before a marker is dropped.
    assert p.feed(" then </th").reasoning == " then"
    d = p.feed("ought more")
    assert d.reasoning == " </thought more" and d.content == ""
    d = p.feed("</think>\n\nDone.")
    assert d.content == "Done." and p.reasoning == "Step one then </thought more"


def test_auto_style_and_prompt_opened() -> None:
    assert template_style("{{ '<think>\\n\\n</think>\\n\\n' if enable_thinking is false }}") == "qwen3"
    assert template_style("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert template_style(None) is None
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<think>old</think> turn<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        check_style("qwen4")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("auto")  # resolved before a parser is made


def test_completion_reasoning_text_and_the_client_option() -> None:
    from tandem import Client
    from tandem.frontend.completion import Completion

    c = Completion("r", text="<think>\nwhy\n</think>\n\nbecause", reasoning_style="qwen3")
    assert (c.reasoning_text, c.content) == ("why", "because")
    assert Completion("r", text="it is\n</think> 4", reasoning_style="deepseek-r1").reasoning_text == "it is"
    plain = Completion("r", text="<think>x</think>y")  # a client without a reasoning parser
    assert (plain.reasoning_text, plain.content) == (None, "<think>x</think>y")
    with pytest.raises(ValueError, match="unknown reasoning parser 'auto'"):  # no template on the client side
        Client("tcp://127.0.0.1:1", reasoning_parser="auto")

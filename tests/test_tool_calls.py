"""The incremental tool-call parser: the same content and calls fed whole or in any pieces, content
streaming ahead of a call, and text that is not a call staying content."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.frontend.http.tool_calls import ParsedDelta, ToolCallParser

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "when": ["now", '
    '{"x": "a \\"}\\" b"}]}}\n</tool_call>\n<tool_call>{"arguments": {"q": 1}, "name": "later"}</tool_call>\n'
)
TEXTS = {
    "auto": [
        HERMES,
        "plain answer",
        "a < b <tool",
        "no <tool_call> here",
        '<tool_call>{"x": 1}</tool_call>',
        '<tool_call>{"name": "a", "arguments": </tool_call>',
        '<tool_call>{"name": "a", "arguments": {"k": [1',
        '<tool_call>{"name": "a"}</tool_call> then text',
        '<tool_call>{"name": "s", "arguments": "{\\"k\\": 2}"}</tool_call>',
        'x <tool_call><tool_call>{"name": "n", "arguments": {}}</tool_call>y',
    ],
    "required": [
        '[{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "b", "arguments": {"v": [1, "]"]}}]',
        '[{"name": "get_time", "arguments": {"tz": "U',
    ],
    "named": ['{"city": "Oslo"}', '{"city": "Os'],
}


def _parser(mode: str) -> ToolCallParser:
    return ToolCallParser(mode, "get_weather" if mode == "named" else None)


def _whole(mode: str, text: str) -> ToolCallParser:
    p = _parser(mode)
    p.feed(text)
    p.finish()
    return p


def _assemble(deltas: list[ParsedDelta]) -> tuple[str, list[tuple[str, str]]]:
    """What a streaming client builds: content, and (name, arguments) per call index."""
    content, names, args = "", {}, {}
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            if "id" in tc:
                assert tc["index"] not in names and tc["type"] == "function"
                names[tc["index"]] = tc["function"]["name"]
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert sorted(names) == list(range(len(names))) == sorted(args)
    return content, [(names[i], args[i]) for i in range(len(names))]


def test_whole_text() -> None:
    p = _whole("auto", HERMES)
    assert p.content == "Let me check."
    assert [(c.name, c.arguments) for c in p.calls] == [
        ("get_weather", '{"city": "Paris", "when": ["now", {"x": "a \\"}\\" b"}]}'), ("later", '{"q": 1}')]
    assert p.calls[0].id.startswith("call_") and p.calls[0].id != p.calls[1].id
    # Not a call: the text stays content, never a half-parsed call.
    for bad in TEXTS["auto"][1:6]:
        p = _whole("auto", bad)
        assert (p.content, p.calls) == (bad, []), bad
    p = _whole("auto", '<tool_call>{"name": "a"}</tool_call> then text')
    assert p.content == "then text" and p.calls[0].arguments == "{}"
    assert _whole("auto", TEXTS["auto"][8]).calls[0].arguments == '{"k": 2}'  # arguments as a JSON string
    p = _whole("auto", TEXTS["auto"][6])  # cut off by max_tokens inside the arguments: they stay cut
    assert p.content == "" and (p.calls[0].name, p.calls[0].arguments) == ("a", '{"k": [1')
    p = _whole("required", TEXTS["required"][0])
    assert [(c.name, c.arguments) for c in p.calls] == [
        ("get_time", '{"tz": "UTC"}'),
        ("b", '{"v": [1, "]"]}'),
    ]
    assert p.content == ""
    assert [(c.name, c.arguments) for c in _whole("named", '{"city": "Oslo"}').calls] == [
        ("get_weather", '{"city": "Oslo"}')]


def test_content_streams_ahead_and_arguments_grow() -> None:
    p = _parser("auto")
    assert p.feed("Let me ").content == "Let me"  # trailing whitespace waits: a call may follow it
    assert p.feed("check.\n<tool").content == " check."  # the newline and partial tag are held
    assert p.feed("_call>\n{\"name\": \"get_weather\", ").tool_calls == []
    first = p.feed('"arguments": {"ci').tool_calls
    assert first == [{"index": 0, "id": p.calls[0].id, "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"ci'}}]
    assert p.feed('ty": "Paris"}}\n</tool_').tool_calls == [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}
    ]
    assert not p.feed("call>") and not p.finish()
    named = _parser("named")
    assert named.feed("").tool_calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert named.feed('{"city"').tool_calls == [{"index": 0, "function": {"arguments": '{"city"'}}]


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from([(m, t) for m, ts in TEXTS.items() for t in ts]), cuts=st.lists(st.integers(0, 200))
)
def test_any_pieces_add_up_to_the_whole(case: tuple[str, str], cuts: list[int]) -> None:
    mode, text = case
    whole = _whole(mode, text)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    p = _parser(mode)
    deltas = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    assert _assemble(deltas) == (whole.content, [(c.name, c.arguments) for c in whole.calls])

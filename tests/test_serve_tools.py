"""Tool calls read back from model text: Qwen2.5's tagged blocks, bare objects, and streaming
(fed a character at a time, or in random pieces) giving the same split as the whole text; a
held call streamed as it is written, its stretches adding up to its arguments."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npuchat.app.serve.call_splitter import Piece, ToolCallSplitter, split_reply

NAMES = frozenset({"get_weather", "lookup"})
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
DEEP = '{"name": "lookup", "arguments": ' + "[" * 20_000


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"<tool_call>\n{CALL}\n</tool_call>", "", [("get_weather", {"city": "Paris"})]),
        (
            f"Sure.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>"
            '{"name": "lookup", "arguments": {"word": "fox"}}</tool_call>',
            "Sure.",
            [("get_weather", {"city": "Paris"}), ("lookup", {"word": "fox"})],
        ),
        (CALL, "", [("get_weather", {"city": "Paris"})]),  # bare, as small models write it
        ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),
        (  # a block naming a tool the request did not offer is text, not a made-up call
            '<tool_call>{"name": "wear_toronto", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "wear_toronto", "arguments": {}}</tool_call>',
            [],
        ),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("a < b and <tool", "a < b and <tool", []),
        (f"<tool_call>{CALL}", "", [("get_weather", {"city": "Paris"})]),  # ended by EOS
        ('<tool_call>{"name": "get_w', '<tool_call>{"name": "get_w', []),  # cut by max_tokens
        ("{}", "{}", []),
        (f"```json\n{CALL}\n```", "", [("get_weather", {"city": "Paris"})]),  # fenced
        ('```json\n{"a": 1}\n```', '```json\n{"a": 1}\n```', []),
        ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
        ("`x` ``", "`x` ``", []),
        (  # several bare calls, one a line (qwen2.5-coder-0.5b under `auto`)
            f'{CALL}\n{{"name": "lookup", "arguments": {{"word": "fox"}}}}\n',
            "",
            [("get_weather", {"city": "Paris"}), ("lookup", {"word": "fox"})],
        ),
        (  # one of them names no offered tool: all text
            f'{CALL}\n{{"name": "rm_rf", "arguments": {{}}}}',
            f'{CALL}\n{{"name": "rm_rf", "arguments": {{}}}}',
            [],
        ),
        (f"{CALL} and then", f"{CALL} and then", []),  # prose after the object: text
        (f"```json\n{CALL}\n{CALL}\n```", "", [("get_weather", {"city": "Paris"})] * 2),
        (DEEP, DEEP, []),  # nested past the JSON parser's depth: text, not a crash
        (  # the tag's text inside an argument does not end the block
            '<tool_call>{"name": "lookup", "arguments": {"word": "a</tool_call>\\"b"}}</tool_call>',
            "",
            [("lookup", {"word": 'a</tool_call>"b'})],
        ),
    ],
)
@pytest.mark.parametrize("stream_calls", [False, True])
def test_split_whole_and_streamed(
    text: str, content: str, calls: list[tuple[str, dict[str, str]]], stream_calls: bool
) -> None:
    """The same with the calls streamed as they are written (a held call's reply), except
    that a reply opening as bare calls is then read as the calls the grammar held it to
    (its objects that are calls, whatever else it holds), the same whole as streamed."""
    got_content, got_calls = split_reply(text, NAMES, stream_calls=stream_calls)
    splitter = ToolCallSplitter(NAMES, stream_calls=stream_calls)
    pieces = [p for ch in text for p in splitter.feed(ch)] + splitter.flush()
    streamed = "".join(p.text for p in pieces if p.call is None)
    _check_streamed_calls(pieces)
    assert all(c.id.startswith("call_") for c in got_calls)
    streamed_calls = [p.call for p in pieces if p.complete and p.call is not None]
    assert [(c.name, c.arguments) for c in streamed_calls] == [
        (c.name, c.arguments) for c in got_calls
    ]
    assert (streamed.strip() if got_calls else streamed) == got_content
    if stream_calls and "".join(text.split()).startswith(('{"name"', '```json{"name"')):
        return
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def _check_streamed_calls(pieces: list[Piece]) -> None:
    """Each streamed call opens, its stretches add up to the arguments it ends with, and the
    pieces of one call share its id."""
    open_call = None
    sent = ""
    for p in pieces:
        if p.stage == "open":
            assert open_call is None and p.call is not None and p.call.arguments == ""
            open_call, sent = p.call, ""
        elif p.stage == "more":
            assert open_call is not None and p.call == open_call and p.text
            sent += p.text
        elif p.stage == "end":
            assert open_call is not None and p.call is not None
            assert (p.call.id, p.call.name, p.call.arguments) == (
                open_call.id,
                open_call.name,
                sent,
            )
            open_call = None
    assert open_call is None


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(alphabet=st.sampled_from('ab }{"\\<>/\n_tool_call\u00e9\u4e2d'), max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet="abc}<", max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    arguments=st.dictionaries(st.text(alphabet="xyz", max_size=3), JSON, max_size=4),
    indent=st.sampled_from([None, 1, 2]),
    space=st.sampled_from(["", " ", "\n", " \n  "]),
    form=st.sampled_from(["tag", "bare", "fenced"]),
    cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=30),
)
def test_a_held_call_streams_as_written(
    arguments: dict[str, Any], indent: int | None, space: str, form: str, cuts: list[int]
) -> None:
    """A call in any JSON layout, in a block, bare or in a json code block (the grammar holds
    each), fed in random pieces: the name comes out before the call's object ends, the
    arguments' stretches come out as written (none of the object's close), add up to the
    model's own text of the arguments, and the whole reply reads the same."""
    written = json.dumps(arguments, indent=indent, ensure_ascii=False)
    block = f'{{"name": "lookup",{space}"arguments":{space}{written}{space}}}'
    before = "Let me see.\n" if form == "tag" else ""
    text = {
        "tag": f"{before}<tool_call>\n{block}\n</tool_call>",
        "bare": f"{block}\n",
        "fenced": f"```json\n{block}\n```",
    }[form]
    close = text.index(block) + len(block) - 1  # the object's last character
    splitter = ToolCallSplitter(NAMES, stream_calls=True)
    pieces: list[Piece] = []
    at = 0
    for cut in sorted({c for c in cuts if c < close} | {close}):
        pieces += splitter.feed(text[at:cut])
        at = cut
    before_close = list(pieces)
    pieces += splitter.feed(text[close:]) + splitter.flush()
    assert [p.stage for p in before_close if p.call is not None][:1] == ["open"]
    _check_streamed_calls(pieces)
    (end,) = [p.call for p in pieces if p.complete]
    assert end is not None and end.arguments == written and json.loads(end.arguments) == arguments
    assert "".join(p.text for p in pieces if p.call is None) == before
    content, (whole,) = split_reply(text, NAMES, stream_calls=True)
    assert content == before.strip() and whole.arguments == written


def test_a_held_call_cut_short_is_a_call_as_far_as_written() -> None:
    """max_tokens in the middle of a held call: the stream had begun it, so the whole reply
    reads it as a call too, with its arguments as far as they were written."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = split_reply(text, NAMES, stream_calls=True)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Par')
    ]
    assert split_reply(text, NAMES) == (text, [])  # not held: the text as written


def test_plain_text_streams_without_waiting() -> None:
    splitter = ToolCallSplitter(NAMES)
    assert [p.text for p in splitter.feed("Hello there")] == ["Hello there"]
    assert [p.text for p in splitter.feed(" <tool")] == [" "]


def test_parallel_tool_calls_false_keeps_the_first_bare_call() -> None:
    text = f'{CALL}\n{{"name": "lookup", "arguments": {{"word": "fox"}}}}'
    content, calls = split_reply(text, NAMES, one=True)
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    splitter = ToolCallSplitter(NAMES, one=True)
    pieces = [p for ch in text for p in splitter.feed(ch)] + splitter.flush()
    assert [p.call.name for p in pieces if p.call] == ["get_weather"]

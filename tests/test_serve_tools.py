"""Tool calls read back from model text: Qwen2.5's tagged blocks, bare objects, and streaming
(fed a character at a time) giving the same split as the whole text."""

from __future__ import annotations

import json

import pytest

from npuchat.app.serve.tools import ToolCallSplitter, split_reply

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
    ],
)
def test_split_whole_and_streamed(
    text: str, content: str, calls: list[tuple[str, dict[str, str]]]
) -> None:
    got_content, got_calls = split_reply(text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    splitter = ToolCallSplitter(NAMES)
    pieces = [p for ch in text for p in splitter.feed(ch)] + splitter.flush()
    streamed = "".join(p.text for p in pieces)
    assert (streamed.strip() if calls else streamed) == content
    assert [p.call.name for p in pieces if p.call] == [name for name, _ in calls]


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

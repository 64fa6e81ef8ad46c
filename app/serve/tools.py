"""Tool calls read back out of the model's text.

Qwen2.5's template (and Hermes-style ones) tells the model to answer a tool request with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; this module turns those blocks into
OpenAI `tool_calls` and leaves the rest as content. Small models often drop the tags and
answer with bare objects, or with them in a json code block (qwen2.5-coder-0.5b does both): a
reply that is nothing but such objects naming the request's tools, one or several a line apart,
bare or fenced, is those calls. A block whose JSON does not parse, that lacks a name or that
names a tool the request did not offer (the 0.5B model has called `wear_toronto`) stays text:
a wrong tool call is worse than showing what the model wrote.

A call the request forces (`tool_choice` "required" or a named function) is held to a grammar,
as llama.cpp's server does: after the block's opening, a JSON object naming one of the tools
with arguments its parameters' schema allows, then the block's end ("required": one call or
more). A tool's parameters llguidance cannot compile leave its arguments any JSON value; a
grammar that fails as a whole leaves the call to the model, with the opening and the name
written in for it (`forced_call_prefix`). Under `auto` the reply is free, but a block the model
opens (`call_grammar` with the newline after the tag) or a reply that begins as a bare call
(`bare_call_grammar`) is held from there to the same calls, as llama.cpp's lazy grammars do.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from npuchat.engine.events import ToolCall, ToolSpec
from npuchat.engine.grammar import embedded_json, grammar_problem

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BARE_OPENING = '{"name"'  # how a bare call begins, whitespace left out (`bare_call_grammar`)
FENCE = "```json"
_FENCED = re.compile(r"```json[ \t]*\n(.*?)\n?```", re.DOTALL)


def forced_call_prefix(name: str | None) -> str:
    """The start of a reply that must be a tool call: the block's opening, and the function's
    name when one is required. The model writes the rest (llama.cpp's server constrains it
    with a grammar instead; a model that wanders off leaves text, never a made-up call)."""
    if name is None:
        return OPEN + '\n{"name": "'
    return OPEN + "\n" + json.dumps({"name": name})[:-1] + ', "arguments": '


def call_grammar(
    tools: tuple[ToolSpec, ...], name: str | None, several: bool, lead: str = ""
) -> str | None:
    """The Lark grammar of what follows a forced call's opening (module doc): a call to `name`
    (None: to any of `tools`), one or, given `several`, more; `lead`: text before the first
    call (the newline after a `<tool_call>` the model wrote itself); None where llguidance
    cannot compile it as a whole (a tool's parameters it cannot compile are left out:
    `_parameters`)."""
    one = not several
    head = "start: LEAD call" if lead else "start: call"
    lines = [head + (" END?" if one else " (NEXT call)* END?")]
    if lead:
        lines.append(f"LEAD: {json.dumps(lead)}")
    if not one:
        lines.append(f"NEXT: {json.dumps(chr(10) + CLOSE + chr(10) + OPEN + chr(10))}")
    lines += [f"END: {json.dumps(chr(10) + CLOSE)}", _call_rule(tools, name)]
    lark = "\n".join(lines) + "\n"
    return lark if grammar_problem(lark) is None else None


def bare_call_grammar(tools: tuple[ToolSpec, ...], several: bool) -> str | None:
    """The Lark grammar of a reply that is bare call objects, as small models write calls
    (`bare_calls`): one or, given `several`, more a line apart, nothing after; None where
    llguidance cannot compile it."""
    lines = ["start: WS? call" + ("" if not several else " (SEP call)*"), r"WS: /[ \t\n]+/"]
    if several:
        lines.append(r"SEP: /[ \t]*\n[ \t\n]*/")
    lark = "\n".join([*lines, _call_rule(tools, None)]) + "\n"
    return lark if grammar_problem(lark) is None else None


def _call_rule(tools: tuple[ToolSpec, ...], name: str | None) -> str:
    """The rule of one call object: a tool's name (`name`'s, or any of `tools`) and the
    arguments its parameters' schema allows."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
        if name is None or t.name == name
    ]
    return f"call: {embedded_json({'anyOf': calls})}"


def _parameters(tool: ToolSpec) -> object:
    """A tool's parameters schema: any object where it gives none, any JSON value where
    llguidance cannot compile it (the call's name is still held to the tools offered)."""
    try:
        schema = json.loads(tool.parameters)
    except ValueError:
        schema = None
    if not isinstance(schema, dict) or not schema:
        return {"type": "object"}
    return schema if grammar_problem(f"start: {embedded_json(schema)}") is None else {}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_call(block: str) -> ToolCall | None:
    """A ToolCall from the JSON inside one block, or None when it is not one."""
    try:
        data = json.loads(block)
    except (ValueError, RecursionError):  # a reply of 10,000 "[" is no call either
        return None
    return _call_of(data)


def bare_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """The calls of a reply that is nothing but call objects naming offered tools, one or
    several with whitespace between (small models write one a line, as llama.cpp's server
    also reads them); [] when it is anything else."""
    decoder = json.JSONDecoder()
    text = text.strip()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return []
        call = _call_of(value)
        if call is None or call.name not in names:
            return []
        calls.append(call)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return calls


def _call_of(data: object) -> ToolCall | None:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(data["name"], text, new_call_id())


@dataclass(frozen=True)
class Piece:
    """A stretch of reply text, or one complete tool call."""

    text: str = ""
    call: ToolCall | None = None


class ToolCallSplitter:
    """Splits streamed reply text into content and tool calls as the text arrives.

    Text that could be the start of `<tool_call>` is held back until it is clearly not;
    inside a block everything waits for `</tool_call>`. A reply that opens with `{` or with a
    json code block is held whole: it may be a bare call, known only at its end.
    """

    def __init__(self, names: frozenset[str] = frozenset(), one: bool = False) -> None:
        self._names = names
        self._one = one  # `parallel_tool_calls` false: bare calls past the first are dropped
        self._buffer = ""
        self._inside = False
        self._bare: bool | None = None if names else False  # None: not known yet

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        head = self._buffer.lstrip()
        if self._bare is None and head and not FENCE.startswith(head):
            self._bare = head.startswith(("{", FENCE))
        if self._bare is not False:
            return []
        out: list[Piece] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return out
                block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._inside = False
                out.append(self._block(block))
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                if start:
                    out.append(Piece(self._buffer[:start]))
                self._buffer = self._buffer[start + len(OPEN) :]
                self._inside = True
                continue
            hold = _partial_suffix(self._buffer, OPEN)
            safe = self._buffer[: len(self._buffer) - hold]
            if safe:
                out.append(Piece(safe))
            self._buffer = self._buffer[len(safe) :]
            return out

    def flush(self) -> list[Piece]:
        """The end of the reply: an unclosed block is still a call if its JSON is whole."""
        rest, self._buffer = self._buffer, ""
        if self._bare is not False:
            self._bare = False
            fenced = _FENCED.fullmatch(rest.strip())
            calls = bare_calls(fenced.group(1) if fenced else rest, self._names)
            if calls:
                return [Piece(call=c) for c in calls[: 1 if self._one else None]]
            return self.feed(rest) + self.flush()
        if self._inside:
            self._inside = False
            return [self._block(rest, closed=False)]
        return [Piece(rest)] if rest else []

    def _block(self, block: str, closed: bool = True) -> Piece:
        """A call, or the block as the model wrote it (an unclosed one without an end)."""
        call = parse_call(block.strip())
        if call is None or call.name not in self._names:
            return Piece(OPEN + block + (CLOSE if closed else ""))
        return Piece(call=call)


def primed_splitter(names: frozenset[str], one: bool, prefix: str = "") -> ToolCallSplitter | None:
    """A splitter for a reply to a request offering the tools `names` (None: none offered,
    the text streams as it comes), fed what the reply was forced to start with (`prefix`:
    an open block, so nothing comes out before its end)."""
    if not names:
        return None
    splitter = ToolCallSplitter(names, one)
    splitter.feed(prefix)
    return splitter


def stream_pieces(splitter: ToolCallSplitter | None, text: str, final: bool = False) -> list[Piece]:
    """The text and calls of the next stretch of a streamed reply (`final`: its end), none
    of them empty."""
    if splitter is None:
        return [Piece(text)] if text else []
    pieces = splitter.flush() if final else splitter.feed(text)
    return [p for p in pieces if p.call is not None or p.text]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_reply(
    text: str, names: frozenset[str] = frozenset(), one: bool = False
) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole reply; `names`: the request's tools (for bare calls);
    `one`: at most one bare call (`parallel_tool_calls` false)."""
    splitter = ToolCallSplitter(names, one)
    pieces = splitter.feed(text) + splitter.flush()
    content = "".join(p.text for p in pieces)
    calls = [p.call for p in pieces if p.call is not None]
    return (content.strip() if calls else content), calls

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
from dataclasses import replace

from npuchat.engine.events import ToolCall, ToolSpec
from npuchat.engine.grammar import embedded_json, grammar_problem

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BARE_OPENING = '{"name"'  # how a bare call begins, whitespace left out (`bare_call_grammar`)
FENCE = "```json"
FENCED_OPENING = FENCE + BARE_OPENING  # and bare calls in a json code block
FENCED_BLOCK = re.compile(r"```json[ \t]*\n(.*?)\n?```", re.DOTALL)
# how a call the grammar holds opens: the name, then its arguments
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')
_DECODER = json.JSONDecoder()


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


def bare_call_grammar(
    tools: tuple[ToolSpec, ...], several: bool, fenced: bool = False
) -> str | None:
    """The Lark grammar of a reply that is bare call objects, as small models write calls
    (`bare_calls`): one or, given `several`, more a line apart, nothing after; `fenced`: in a
    json code block, nothing after its end; None where llguidance cannot compile it."""
    calls = "call" + ("" if not several else " (SEP call)*")
    if fenced:
        lines = [f"start: OPEN_FENCE {calls} CLOSE_FENCE", r"OPEN_FENCE: /```json[ \t]*\n[ \t\n]*/"]
        lines.append(r"CLOSE_FENCE: /[ \t\n]*```/")
    else:
        lines = [f"start: WS? {calls}", r"WS: /[ \t\n]+/"]
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
    """A ToolCall from the JSON inside one block, or None when it is not one. Its arguments
    are the model's own text of them where the block is `{"name": ..., "arguments": {...}}`
    (what the call grammar holds it to: `arguments_at`), so a call streamed as it is written
    ends with the same text (`call_splitter`); else they are written out again."""
    try:
        data = json.loads(block)
    except (ValueError, RecursionError):  # a reply of 10,000 "[" is no call either
        return None
    call = _call_of(data)
    if call is None or not isinstance(data.get("arguments"), dict):
        return call
    start = arguments_at(block, call.name)
    if start is None:
        return call
    try:
        _, end = _DECODER.raw_decode(block, start)
    except (ValueError, RecursionError):
        return call
    return replace(call, arguments=block[start:end]) if block[end:].strip() == "}" else call


def arguments_at(block: str, name: str | None = None) -> int | None:
    """Where the arguments of a block that opens `{"name": NAME, "arguments": ` begin (their
    first character written so far, whitespace left out), or None where it does not open so
    (yet); `name`: the name it must have (None: an offered one is checked by the caller)."""
    head = _HEAD.match(block)
    if head is None or _name(head) is None or (name is not None and _name(head) != name):
        return None
    start = head.end()
    while start < len(block) and block[start].isspace():
        start += 1
    return start


def call_name(block: str) -> str | None:
    """The name a block opening a call gives (`arguments_at`), None before it is known."""
    head = _HEAD.match(block)
    return _name(head) if head is not None else None


def _name(head: re.Match[str]) -> str | None:
    try:
        name = json.loads(head.group(1))
    except ValueError:  # an escape JSON does not know
        return None
    return name if isinstance(name, str) else None


def bare_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """The calls of a reply that is nothing but call objects naming offered tools, one or
    several with whitespace between (small models write one a line, as llama.cpp's server
    also reads them); [] when it is anything else."""
    decoder = _DECODER
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

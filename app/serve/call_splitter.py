"""A streamed reply split into its text and its tool calls as it arrives.

Text that could be the start of `<tool_call>` is held back until it is clearly not. A block's
call comes out whole at the block's end; or, where the request's grammar holds its calls
(`stream_calls`: a forced call, or `auto`'s lazy grammar), as it is written, the way OpenAI's
and Anthropic's streams give a call: its name once the block names an offered tool, then its
arguments a stretch at a time, then its end. Only held calls are streamed so: the grammar
makes the block `{"name": ..., "arguments": {...}}` and nothing else, so the stretches sent
are the arguments' own text, never taken back (`tools.parse_call` ends the call with the same
text). A reply that opens with `{` or a json code block is held whole: it may be bare calls,
known only at its end; unless the grammar holds it from its opening (`{"name"`, or the code
block's opening and `{"name"`: `tools.bare_call_grammar`), when each object is a call, streamed
as a block's is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Protocol

from npuchat.engine.events import ToolCall

from .tools import (
    BARE_OPENING,
    CLOSE,
    FENCE,
    FENCED_BLOCK,
    FENCED_OPENING,
    OPEN,
    arguments_at,
    bare_calls,
    call_name,
    new_call_id,
    parse_call,
)

Stage = Literal["whole", "open", "more", "end"]
_HELD = (BARE_OPENING, FENCED_OPENING)  # how a reply of held bare calls opens, spaces left out


@dataclass(frozen=True)
class Piece:
    """A stretch of reply text (`call` None), or a tool call: `whole`, or streamed as it is
    written: `open` (its name and id), `more` (the next stretch of its arguments, `text`),
    `end` (the call with all its arguments)."""

    text: str = ""
    call: ToolCall | None = None
    stage: Stage = "whole"

    @property
    def complete(self) -> bool:
        """A call with all its arguments: what a whole reply lists."""
        return self.call is not None and self.stage in ("whole", "end")


class ToolCallSplitter:
    """Splits streamed reply text into content and tool calls (module doc)."""

    def __init__(
        self,
        names: frozenset[str] = frozenset(),
        one: bool = False,
        stream_calls: bool = False,
        prefix: str = "",
    ) -> None:
        """`prefix`: what the reply was forced to start with (a call's opening), read with
        the first text fed."""
        self._names = names
        self._one = one  # `parallel_tool_calls` false: bare calls past the first are dropped
        self._stream = stream_calls
        self._buffer = prefix
        self._inside = False
        self._bare: bool | None = None if names else False  # None: not known yet
        self._open: ToolCall | None = None  # the call being streamed
        self._sent: list[str] = []  # its arguments' stretches sent so far
        self._sent_chars = 0
        self._scan = _Scan()  # where the open block's end is looked for
        self._object: int | None = None  # where the bare call being read begins
        self._held: bool | None = None  # the reply is held bare calls (None: not known yet)

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        head = self._buffer.lstrip()
        if self._bare is None and head and not FENCE.startswith(head):
            self._bare = head.startswith(("{", FENCE))
        if self._bare is not False:
            return self._bare_calls() if self._stream and self._held_bare() else []
        out: list[Piece] = []
        while True:
            if self._inside:
                end = self._scan.close(self._buffer)
                if end < 0:
                    return out + self._written(self._buffer)
                block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._inside = False
                out += self._block(block)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                if start:
                    out.append(Piece(self._buffer[:start]))
                self._buffer = self._buffer[start + len(OPEN) :]
                self._inside, self._scan = True, _Scan()
                continue
            hold = _partial_suffix(self._buffer, OPEN)
            safe = self._buffer[: len(self._buffer) - hold]
            if safe:
                out.append(Piece(safe))
            self._buffer = self._buffer[len(safe) :]
            return out

    def flush(self) -> list[Piece]:
        """The end of the reply: an unclosed block is still a call if its JSON is whole."""
        if self._stream and self._bare and self._held_bare():
            return self._bare_calls(final=True)
        rest, self._buffer = self._buffer, ""
        if self._bare is not False:
            self._bare = False
            fenced = FENCED_BLOCK.fullmatch(rest.strip())
            calls = bare_calls(fenced.group(1) if fenced else rest, self._names)
            if calls:
                return [Piece(call=c) for c in calls[: 1 if self._one else None]]
            return self.feed(rest) + self.flush()
        if self._inside:
            self._inside = False
            return self._block(rest, closed=False)
        return [Piece(rest)] if rest else []

    def _written(self, block: str) -> list[Piece]:
        """A held call's name and the stretch of its arguments written since the last (the
        end that may be the object's close, or the block's, waits)."""
        if not self._stream:
            return []
        out: list[Piece] = []
        if self._open is None:
            name = call_name(block)
            if name is None or name not in self._names or arguments_at(block) is None:
                return []
            self._open, self._sent, self._sent_chars = ToolCall(name, "", new_call_id()), [], 0
            out.append(Piece(call=self._open, stage="open"))
        start = arguments_at(block)
        assert start is not None  # it opened so
        end = _ready_end(block, start, len(block) - _partial_suffix(block, CLOSE))
        if end - start > self._sent_chars:  # only the new stretch is read: a long argument
            more = block[start + self._sent_chars : end]  # costs no more per piece
            self._sent.append(more)
            self._sent_chars = end - start
            out.append(Piece(more, self._open, "more"))
        return out

    def _held_bare(self) -> bool:
        """Whether the reply opens as bare calls (or calls in a json code block) the grammar
        holds from there (`tools.bare_call_grammar`: its openings)."""
        if self._held is None:
            head = "".join(self._buffer[:64].split())  # enough to tell
            if head.startswith(_HELD):
                self._held = True
            elif not any(o.startswith(head) for o in _HELD):
                self._held = False
        return bool(self._held)

    def _bare_calls(self, final: bool = False) -> list[Piece]:
        """A held reply of bare calls, read as it is written: each object a call, streamed
        as a block's call is; the code block's fences and the space between are no text."""
        out: list[Piece] = []
        while True:
            if self._object is None:
                at = self._scan.at
                if self._buffer.startswith(FENCE, at) and "\n" in self._buffer[at:]:
                    at = self._buffer.index("\n", at)  # the code block's opening line
                while at < len(self._buffer) and self._buffer[at].isspace():
                    at += 1
                self._scan.at = at
                if not self._buffer.startswith("{", at):
                    break
                self._object, self._scan = at, _Scan(at)
            end = self._scan.object_end(self._buffer)
            block = self._buffer[self._object : end if end >= 0 else len(self._buffer)]
            if end < 0:
                out += self._written(block)
                break
            out += self._block(block, written=block)
            self._object, self._scan = None, _Scan(end)
        if not final:
            return out
        if self._object is not None:  # cut short
            out += self._block(self._buffer[self._object :], written=self._buffer[self._object :])
        rest = self._buffer[self._scan.at :].strip()
        rest = rest.removeprefix(FENCE).strip().removesuffix("```").strip()
        return [*out, Piece(rest)] if rest and self._object is None else out

    def _block(self, block: str, closed: bool = True, written: str | None = None) -> list[Piece]:
        """A call, or the block as the model wrote it (`written`, else inside its tags, an
        unclosed one without an end); a streamed call ends with the rest of its arguments."""
        call = parse_call(block.strip())
        opened, self._open = self._open, None
        if opened is not None:  # its name and id went out: it ends as a call
            sent = "".join(self._sent)
            arguments = call.arguments if call is not None else ""
            if call is None or call.name != opened.name or not arguments.startswith(sent):
                arguments = _written_arguments(block)  # not what was held: as written
            rest = arguments[len(sent) :]
            more = [Piece(rest, opened, "more")] if rest else []
            return [*more, Piece(call=replace(opened, arguments=arguments), stage="end")]
        if call is None or call.name not in self._names:
            if written is None:
                written = OPEN + block + (CLOSE if closed else "")
            return [Piece(written)]
        return [Piece(call=call)]


class _Scan:
    """Finds where a block's `</tool_call>` or a bare call's object ends, outside JSON strings
    (a call's argument may hold the tag's text, or braces), reading each character once."""

    def __init__(self, at: int = 0) -> None:
        self.at = at  # the text's characters read
        self.in_string = False
        self.escaped = False
        self.depth = 0  # braces and brackets open

    def _string(self, c: str) -> bool:
        """Read `c` as part of a JSON string, or as its opening quote; False: outside one."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
            return True
        self.in_string = c == '"'
        return self.in_string

    def close(self, block: str) -> int:
        """Where the block ends (-1: not yet)."""
        while self.at < len(block):
            c = block[self.at]
            if not self._string(c) and c == "<":
                if block.startswith(CLOSE, self.at):
                    return self.at
                if CLOSE.startswith(block[self.at :]):
                    return -1  # the tag's start: read again with what follows
            self.at += 1
        return -1

    def object_end(self, text: str) -> int:
        """Where the JSON object read from `at` ends, just past its close (-1: not yet)."""
        while self.at < len(text):
            c = text[self.at]
            self.at += 1
            if self._string(c):
                continue
            if c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self.at
        return -1


def _ready_end(text: str, start: int, end: int) -> int:
    """Where the arguments in `text[start:end]` end for now: before what may be the call
    object's close (a last `}` and the space around it), found from the end."""
    at = end
    while at > start and text[at - 1].isspace():
        at -= 1
    if at > start and text[at - 1] == "}":
        at -= 1
        while at > start and text[at - 1].isspace():
            at -= 1
    return at


def _written_arguments(block: str) -> str:
    """A streamed call's arguments as the block wrote them, its object's close left out."""
    start = arguments_at(block) or 0
    return block[start : _ready_end(block, start, len(block))]


class CallEvents(Protocol):
    """A stream's events for a tool call, whole or as it is written (`call_events`)."""

    def call(self, call: ToolCall) -> list[bytes]: ...
    def call_open(self, call: ToolCall) -> list[bytes]: ...
    def call_more(self, more: str) -> list[bytes]: ...
    def call_end(self, call: ToolCall) -> list[bytes]: ...


def call_events(piece: Piece, events: CallEvents) -> list[bytes]:
    """The events of a call's piece (`piece.call` is set)."""
    assert piece.call is not None
    if piece.stage == "whole":
        return events.call(piece.call)
    if piece.stage == "open":
        return events.call_open(piece.call)
    if piece.stage == "more":
        return events.call_more(piece.text)
    return events.call_end(piece.call)


@dataclass(frozen=True)
class CallReading:
    """How one request's replies are read for tool calls (`Prepared.calls`): the offered
    tools' names (none: the reply is all text), what the reply was forced to start with, at
    most one call, and whether held calls stream as they are written."""

    tools: frozenset[str] = frozenset()
    prefix: str = ""
    one: bool = False
    stream: bool = False

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole reply's text (`split_reply`)."""
        text = self.prefix + text
        return split_reply(text, self.tools, self.one, self.stream) if self.tools else (text, [])

    def splitter(self) -> ToolCallSplitter | None:
        """A splitter for the reply's stream (None: no tools, the text streams as it comes)."""
        return (
            ToolCallSplitter(self.tools, self.one, self.stream, self.prefix) if self.tools else None
        )


def stream_pieces(splitter: ToolCallSplitter | None, text: str, final: bool = False) -> list[Piece]:
    """The text and calls of the next stretch of a streamed reply (`final`: its end), no
    text empty."""
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
    text: str, names: frozenset[str] = frozenset(), one: bool = False, stream_calls: bool = False
) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole reply; `names`: the request's tools (for bare calls);
    `one`: at most one bare call (`parallel_tool_calls` false); `stream_calls`: as the
    reply's stream reads it (a held call the reply cut short is still a call, its arguments
    as far as they were written, as the stream had begun it)."""
    splitter = ToolCallSplitter(names, one, stream_calls)
    pieces = splitter.feed(text) + splitter.flush()
    content = "".join(p.text for p in pieces if p.call is None)
    calls = [p.call for p in pieces if p.complete and p.call is not None]
    return (content.strip() if calls else content), calls

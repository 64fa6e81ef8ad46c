"""Whether bytes can still grow into one JSON object: the check behind JSON mode.

JSON mode (OpenAI's `response_format: {"type": "json_object"}`, ollama's `--format json`) lets
the model write only what keeps its reply a prefix of a valid JSON object (RFC 8259), and ends
the reply when the object closes. llama.cpp does it with a grammar over every token of the
vocabulary; here a small pushdown automaton over bytes is asked about the few tokens the
sampler would pick from (`json_sampling`), which is all a step needs.

Bytes, not characters: a token may hold half a UTF-8 character, which is only ever valid inside
a string, where any byte from 0x20 up is. Whitespace between tokens is limited (`MAX_BLANKS`)
and so is nesting (`MAX_DEPTH`): a model can otherwise loop on newlines forever without
breaking the format.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["MAX_BLANKS", "MAX_DEPTH", "JsonPrefix"]

MAX_BLANKS = 16  # whitespace bytes in a row outside strings
MAX_DEPTH = 32  # objects and arrays open at once

_BLANK = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

# states between values
_START = "start"  # nothing yet: `{` (as llama.cpp's JSON grammar, no whitespace before it)
_VALUE = "value"  # a value
_FIRST_VALUE = "first-value"  # a value or `]` (just after `[`)
_FIRST_KEY = "first-key"  # a key or `}` (just after `{`)
_KEY = "key"  # a key (after `,` in an object)
_COLON = "colon"
_AFTER = "after"  # `,` or the container's end
_DONE = "done"  # the object closed: trailing whitespace only
# states inside a scalar
_STRING = "string"
_ESCAPE = "escape"
_UNICODE = "unicode"
_LITERAL = "literal"
_NUMBER = "number"


@dataclass(frozen=True)
class JsonPrefix:
    """The automaton's state; `feed` returns the state after some bytes, or None where they
    cannot continue a JSON object. Immutable, so every candidate is tried from the same one."""

    state: str = _START
    stack: tuple[str, ...] = ()  # "{" or "[" per open container
    key: bool = False  # the string being read is an object's key
    rest: bytes = b""  # a literal's bytes still to come
    hex_left: int = 0  # a \\u escape's hex digits still to come
    number: str = ""  # where in a number: "-", "0", "int", ".", "frac", "e", "e+", "exp"
    blanks: int = 0  # whitespace bytes in a row

    @property
    def done(self) -> bool:
        """The object is complete (the reply may end here, and must end before more text)."""
        return self.state == _DONE

    def feed(self, data: bytes) -> JsonPrefix | None:
        s = self
        for b in data:
            nxt = s._byte(b)
            if nxt is None:
                return None
            s = nxt
        return s

    def _byte(self, b: int) -> JsonPrefix | None:
        state = self.state
        if state == _STRING:
            if b == 0x22:  # "
                return self._closed_scalar(_COLON if self.key else _AFTER)
            if b == 0x5C:  # backslash
                return replace(self, state=_ESCAPE)
            return self if b >= 0x20 else None
        if state == _ESCAPE:
            if b not in _ESCAPES:
                return None
            if b == ord("u"):
                return replace(self, state=_UNICODE, hex_left=4)
            return replace(self, state=_STRING)
        if state == _UNICODE:
            if b not in _HEX:
                return None
            left = self.hex_left - 1
            return replace(self, state=_UNICODE if left else _STRING, hex_left=left)
        if state == _LITERAL:
            if b != self.rest[0]:
                return None
            if len(self.rest) > 1:
                return replace(self, rest=self.rest[1:])
            return replace(self, state=_AFTER, rest=b"", blanks=0)
        if state == _NUMBER:
            return self._number(b)
        if b in _BLANK:
            if self.blanks >= MAX_BLANKS or state == _START:  # the reply starts at its `{`
                return None
            return replace(self, blanks=self.blanks + 1)
        s = replace(self, blanks=0) if self.blanks else self
        return s._structural(b)

    def _structural(self, b: int) -> JsonPrefix | None:
        state, c = self.state, chr(b)
        if state == _START:
            return self._open("{") if c == "{" else None
        if state == _DONE:
            return None
        if state == _COLON:
            return replace(self, state=_VALUE) if c == ":" else None
        if state in (_FIRST_KEY, _KEY):
            if c == '"':
                return replace(self, state=_STRING, key=True)
            return self._close("{") if c == "}" and state == _FIRST_KEY else None
        if state == _AFTER:
            top = self.stack[-1]
            if c == ",":
                return replace(self, state=_KEY if top == "{" else _VALUE)
            return self._close(top) if c == ("}" if top == "{" else "]") else None
        # _VALUE or _FIRST_VALUE
        if c == "]" and state == _FIRST_VALUE:
            return self._close("[")
        if c in "{[":
            return self._open(c)
        if c == '"':
            return replace(self, state=_STRING, key=False)
        if b in _LITERALS:
            return replace(self, state=_LITERAL, rest=_LITERALS[b])
        if c == "-":
            return replace(self, state=_NUMBER, number="-")
        if b in _DIGITS:
            return replace(self, state=_NUMBER, number="0" if c == "0" else "int")
        return None

    def _open(self, c: str) -> JsonPrefix | None:
        if len(self.stack) >= MAX_DEPTH:
            return None
        state = _FIRST_KEY if c == "{" else _FIRST_VALUE
        return replace(self, state=state, stack=(*self.stack, c))

    def _close(self, c: str) -> JsonPrefix:
        stack = self.stack[:-1]
        return replace(self, state=_AFTER if stack else _DONE, stack=stack)

    def _closed_scalar(self, state: str) -> JsonPrefix:
        return replace(self, state=state, key=False, blanks=0)

    def _number(self, b: int) -> JsonPrefix | None:
        """RFC 8259's number: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?; a byte
        that cannot extend it ends it where it may end, and is read as what follows."""
        n, digit, c = self.number, b in _DIGITS, chr(b)
        nxt = {
            "-": "0" if c == "0" else "int" if digit else None,
            "0": "." if c == "." else "e" if c in "eE" else None,
            "int": "int" if digit else "." if c == "." else "e" if c in "eE" else None,
            ".": "frac" if digit else None,
            "frac": "frac" if digit else "e" if c in "eE" else None,
            "e": "exp" if digit else "e+" if c in "+-" else None,
            "e+": "exp" if digit else None,
            "exp": "exp" if digit else None,
        }[n]
        if nxt is not None:
            return replace(self, number=nxt)
        if n not in ("0", "int", "frac", "exp"):
            return None  # "-", "1.", "1e", "1e+" cannot end
        return replace(self, state=_AFTER, number="")._byte(b)

"""Text from a model or a database, made safe to put on a terminal.

Why: a reply (or a title stored by another program) can contain escape sequences that recolour
the terminal, set its title, write the clipboard (OSC 52) or leave the alternate screen. Printed
verbatim, a model's output would control the user's terminal. Newline and tab are the only
control characters passed through; every other C0/C1 control, DEL, and the bidirectional
overrides that reorder what the eye sees ("trojan source") are shown instead of obeyed.
"""

from __future__ import annotations

import re

# C0 except tab and newline, DEL, C1, and the Unicode bidi embedding/override/isolate controls.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

_NAMES = {"\x1b": "\\e", "\r": "\\r", "\x07": "\\a", "\x08": "\\b"}


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    return _NAMES.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")


def escape_controls(text: str) -> str:
    """`text` with every control character but newline and tab written as a visible escape
    (`\\e[31m` for ESC [31m), for output to a terminal."""
    return _CONTROL.sub(_escape, text)


def _picture(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x20:
        return chr(0x2400 + code)  # the Control Pictures block: ␛ for ESC, ␇ for BEL
    return "\u2421" if code == 0x7F else "\ufffd"


def control_pictures(text: str) -> str:
    """`text` with each control character (but newline and tab) replaced by one visible
    character of the same width as a letter, for the TUI, where widths must not change."""
    return _CONTROL.sub(_picture, text)


def has_controls(text: str) -> bool:
    return _CONTROL.search(text) is not None

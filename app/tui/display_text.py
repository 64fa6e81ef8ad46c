"""Text as the terminal will draw it: emoji sequences whose width terminals disagree on are
split into parts every terminal draws alike.

Rich (and so Textual) measures a skin-tone emoji, a ZWJ family or "❤️" (a heart with variation
selector 16) as one 2-cell character; tmux 3.3 draws 👍🏽 in 4 cells and ❤️ in 1, so a line
holding one ends a cell or two off and pushes the right border. Without the skin-tone modifier,
the zero-width joiner and VS16 the parts have the same width everywhere. Only what is shown
changes: the stored and copied text keep every character.
"""

from __future__ import annotations

import re

_AMBIGUOUS = re.compile("[\u200d\ufe0f\U0001f3fb-\U0001f3ff]")


def for_terminal(text: str) -> str:
    return _AMBIGUOUS.sub("", text)

"""The last line of defence between stored text and the terminal: every line the app draws
has its control characters replaced by visible ones (`text_safety.control_pictures`).

Why a line filter and not escaping in each widget: a title, a message, a notification or an
error can each carry text written by a model or another program, and one missed widget would be
enough for `ESC ] 0 ;` to retitle the terminal or `ESC [ ? 1049 l` to leave the alternate screen.
Textual applies line filters to everything the compositor draws, so nothing is missed.
"""

from __future__ import annotations

from rich.segment import Segment
from textual.color import Color
from textual.filter import LineFilter

from npuchat.app.text_safety import control_pictures, has_controls


class ControlCharacterFilter(LineFilter):
    """Replace control characters in drawn text, keeping each line's width."""

    def apply(self, segments: list[Segment], background: Color) -> list[Segment]:
        if not any(seg.control is None and has_controls(seg.text) for seg in segments):
            return segments
        width = Segment.get_line_length(segments)
        out = [
            Segment(control_pictures(seg.text), seg.style)
            if seg.control is None and has_controls(seg.text)
            else seg
            for seg in segments
        ]
        # A control character measures 0 cells and its picture 1: crop back to the width.
        return Segment.adjust_line_length(out, width)

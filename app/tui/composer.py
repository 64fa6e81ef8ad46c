"""The message input: a multi-line TextArea where Enter sends and Shift+Enter / Ctrl+J add a
line break (terminals without the kitty keyboard protocol cannot tell Shift+Enter from Enter,
so Ctrl+J is the one that always works)."""

from __future__ import annotations

from textual.message import Message
from textual.widgets import TextArea

from npuchat.app.tui.keys import bindings


class Composer(TextArea):
    BINDINGS = bindings("send", "newline")

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus")

    def action_submit(self) -> None:
        # Read the text after keys already queued behind Enter are applied: in a burst (a
        # terminal without bracketed paste, a script driving the terminal) Enter can be handled
        # before the characters typed just before it, which would send half the message.
        self.call_after_refresh(self._submit_now)

    def _submit_now(self) -> None:
        if self.text.strip():
            self.post_message(self.Submitted(self.text))

    def action_newline(self) -> None:
        self.insert("\n")

"""The message input: a multi-line TextArea where Enter sends and Shift+Enter / Ctrl+J add a
line break (terminals without the kitty keyboard protocol cannot tell Shift+Enter from Enter,
so Ctrl+J is the one that always works)."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import TextArea

from npuchat.app.tui.keys import bindings


class Composer(TextArea):
    BINDINGS = bindings("send", "newline")

    editing: reactive[int | None] = reactive(None, init=False)
    """The id of the earlier message being edited (None: writing a new message)."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus")
        self.edit_drops = 0
        self._typed: list[str] = []

    async def _on_key(self, event: events.Key) -> None:
        """Collect typed characters and insert them in one edit after the keys queued now.

        Why: every edit re-wraps the line it touches, so text that arrives as one key per
        character (a terminal without bracketed paste, `tmux paste-buffer`) cost O(n) per key:
        10,000 characters took 16 s of CPU and 100,000 blocked the UI for minutes. One edit per
        burst makes it linear, and the event loop stays free between bursts.
        """
        if event.is_printable and event.character and not self.read_only:
            event.stop()
            event.prevent_default()
            if not self._typed:
                self.call_later(self._insert_typed)
            self._typed.append(event.character)
            return
        self._insert_typed()
        await super()._on_key(event)

    def _insert_typed(self) -> None:
        if self._typed:
            text, self._typed = "".join(self._typed), []
            self._replace_via_keyboard(text, *self.selection)

    def action_submit(self) -> None:
        # Read the text after keys already queued behind Enter are applied: in a burst (a
        # terminal without bracketed paste, a script driving the terminal) Enter can be handled
        # before the characters typed just before it, which would send half the message.
        self.call_after_refresh(self._submit_now)

    def _submit_now(self) -> None:
        self._insert_typed()
        if self.text.strip():
            self.post_message(self.Submitted(self.text))

    def action_newline(self) -> None:
        self._insert_typed()
        self.insert("\n")

    def begin_edit(self, message_id: int, text: str, later: int) -> None:
        """Edit an earlier message; `later` messages after it go when (only when) it is sent."""
        self.edit_drops = later
        self.editing = message_id
        self.text = text
        self.move_cursor(self.document.end)
        self.focus()

    def watch_editing(self, editing: int | None) -> None:
        self.set_class(editing is not None, "-editing")
        if editing is None:
            self.border_title = "Message"
            return
        n = self.edit_drops
        drops = f"Enter replaces the {n} message{'s' * (n != 1)} after it" if n else "Enter sends"
        self.border_title = f"Editing · {drops} · Esc cancels and keeps them"

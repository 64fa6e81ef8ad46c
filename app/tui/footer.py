"""The chat footer: Textual's Footer, showing only the essential keys on narrow terminals.

Every key still works and F1 lists them all; the footer just stops cutting keys off at the
right edge when there is no room for all of them.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widgets import Footer
from textual.widgets._footer import FooterKey

ESSENTIAL_ACTIONS = frozenset(
    {"submit", "stop", "continue_reply", "new_chat", "toggle_sidebar", "help", "command_palette"}
)


class ChatFooter(Footer):
    essential_only: reactive[bool] = reactive(False, recompose=True)

    def compose(self) -> ComposeResult:
        for widget in super().compose():
            if (
                self.essential_only
                and isinstance(widget, FooterKey)
                and widget.action.removeprefix("app.") not in ESSENTIAL_ACTIONS
            ):
                continue
            yield widget

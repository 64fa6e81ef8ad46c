"""The chat footer: Textual's Footer, showing only the essential keys on narrow terminals.

Every key still works and F1 lists them all; the footer just stops cutting keys off at the
right edge when there is no room for all of them.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widgets import Footer
from textual.widgets._footer import FooterKey

from npuchat.app.tui.watchers import drop_closed_watchers

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

    async def recompose(self) -> None:
        """Rebuild the keys (Textual does on every focus or binding change), then let the
        removed keys go: each binds `compact` to this footer, which changes only when the
        terminal crosses a width breakpoint. Without this every focus change kept ~14 dead
        keys (~20 KiB each) alive for the life of the app."""
        await super().recompose()
        drop_closed_watchers(self)

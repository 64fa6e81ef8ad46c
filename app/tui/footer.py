"""The chat footer: Textual's Footer, showing only the essential keys on narrow terminals.

Every key still works and F1 lists them all; the footer just stops cutting keys off at the
right edge when there is no room for all of them.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.dom import DOMNode
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

    async def recompose(self) -> None:
        """Rebuild the keys (Textual does on every focus or binding change), then let the
        removed keys go: each binds `compact` to this footer, and Textual drops such a watcher
        only when `compact` changes, which it never does here. Without this every focus change
        kept ~14 dead keys (~20 KiB each) alive for the life of the app."""
        await super().recompose()
        drop_closed_watchers(self)


def drop_closed_watchers(node: DOMNode) -> int:
    """Remove the watchers that removed widgets left on `node`'s reactives; return how many.

    Textual keeps a watcher on the watched object until that attribute next changes
    (Textualize/textual#6666), so a long-lived node watched by short-lived widgets holds every
    one of them. This applies Textual's own pruning rule (the watching node is closing) now.
    """
    watchers: dict[str, list[tuple[DOMNode, object]]] = getattr(node, "__watchers", {})
    dropped = 0
    for name, entries in watchers.items():
        alive = [(owner, callback) for owner, callback in entries if not owner._closing]
        dropped += len(entries) - len(alive)
        watchers[name][:] = alive
    return dropped

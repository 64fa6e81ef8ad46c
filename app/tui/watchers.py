"""Releasing the watchers that removed widgets leave on long-lived ones.

A widget that watches another node's reactive (`self.watch(app, "theme", ...)`, as every
TextArea does, or `data_bind`, as every footer key does) is registered on the *watched* node,
and Textual drops that registration only when the watched attribute next changes
(Textualize/textual#6666). Until then the removed widget, with its document, styles and render
caches, stays alive. The app's theme and the footer's `compact` rarely change, so without this
every settings dialog and every footer rebuild stayed in memory for the life of the app.
"""

from __future__ import annotations

from textual.dom import DOMNode


def drop_closed_watchers(node: DOMNode) -> int:
    """Remove the watchers of `node`'s reactives whose watching widget is closing or closed
    (Textual's own pruning rule, applied now); return how many were removed."""
    watchers: dict[str, list[tuple[DOMNode, object]]] = getattr(node, "__watchers", {})
    dropped = 0
    for entries in watchers.values():
        alive = [(owner, callback) for owner, callback in entries if not owner._closing]
        dropped += len(entries) - len(alive)
        entries[:] = alive
    return dropped

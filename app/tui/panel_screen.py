"""A screen with a sidebar, a chat column and an engine panel that collapse by width.

The panels' visibility is reactive state: crossing a width breakpoint resets it to that
width's defaults (`layout_for`), the user's toggles change it, and watchers show or hide the
widgets. Panels that open over the chat close with Esc and after choosing a conversation.
Printable keys typed outside a text field go to the composer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual import events
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import Input, TextArea

from npuchat.app.tui.composer import Composer
from npuchat.app.tui.footer import ChatFooter
from npuchat.app.tui.layout import PanelLayout, layout_for
from npuchat.app.tui.metrics_panel import MetricsPanel
from npuchat.app.tui.sidebar import ConversationList, Sidebar
from npuchat.app.tui.watchers import drop_closed_watchers

if TYPE_CHECKING:
    from npuchat.app.tui.app import NpuchatApp


class PanelScreen(Screen[None]):
    HORIZONTAL_BREAKPOINTS = [  # noqa: RUF012 (Textual declares it an instance variable)
        (0, "-narrow"),
        (80, "-medium"),
        (120, "-wide"),
    ]

    sidebar_visible: var[bool] = var(True, init=False)
    metrics_visible: var[bool] = var(True, init=False)

    def __init__(self) -> None:
        super().__init__()
        self._layout: PanelLayout | None = None

    @property
    def npuchat(self) -> NpuchatApp:
        return cast("NpuchatApp", self.app)

    def on_screen_resume(self) -> None:
        # Back from a dialog: its text areas watched the app's theme; let them go.
        drop_closed_watchers(self.app)

    def on_resize(self, event: events.Resize) -> None:
        self._apply_layout(event.size.width)

    def _apply_layout(self, width: int) -> None:
        """Crossing a width breakpoint resets the panels to that width's defaults."""
        layout = layout_for(width, self.npuchat.settings.show_metrics)
        if layout == self._layout:
            return
        self._layout = layout
        self.set_class(layout.overlay_sidebar, "-overlay-sidebar")
        self.set_class(layout.overlay_metrics, "-overlay-metrics")
        footer = self.query_one(ChatFooter)
        footer.compact = layout.compact_footer
        footer.essential_only = layout.essential_footer
        self.sidebar_visible = layout.sidebar
        self.metrics_visible = layout.metrics
        self.watch_sidebar_visible(layout.sidebar)
        self.watch_metrics_visible(layout.metrics)

    def watch_sidebar_visible(self, visible: bool) -> None:
        self.query_one(Sidebar).display = visible

    def watch_metrics_visible(self, visible: bool) -> None:
        self.query_one(MetricsPanel).display = visible

    # ---- typing anywhere -------------------------------------------------------------------

    def on_key(self, event: events.Key) -> None:
        """A printable key typed outside a text field goes to the composer (unless the focused
        widget binds it: a message's e / c / y), so typing never needs a click first."""
        focused = self.app.focused
        if isinstance(focused, Input | TextArea) or not event.is_printable:
            return
        if event.character is None or event.key in self.active_bindings:
            return
        event.stop()
        event.prevent_default()
        composer = self.query_one(Composer)
        composer.focus()
        composer.insert(event.character)

    # ---- panels ----------------------------------------------------------------------------

    def focus_composer(self) -> None:
        if self._layout is not None and self._layout.overlay_sidebar:
            self.sidebar_visible = False
        self.query_one(Composer).focus()

    def action_search(self) -> None:
        self.sidebar_visible = True
        self.query_one("#search", Input).focus()

    def action_toggle_sidebar(self) -> None:
        self.sidebar_visible = not self.sidebar_visible
        if self.sidebar_visible and self._layout is not None and self._layout.overlay_sidebar:
            self.query_one(ConversationList).focus()
        elif not self.sidebar_visible:
            self.query_one(Composer).focus()

    def action_toggle_metrics(self) -> None:
        self.metrics_visible = not self.metrics_visible
        if self._layout is not None and not self._layout.overlay_metrics:
            self.npuchat.persist_setting("show_metrics", self.metrics_visible)

    def overlay_open(self) -> bool:
        layout = self._layout
        if layout is None:
            return False
        return (layout.overlay_sidebar and self.sidebar_visible) or (
            layout.overlay_metrics and self.metrics_visible
        )

    def close_overlays(self) -> None:
        layout = self._layout
        if layout is None:
            return
        if layout.overlay_sidebar:
            self.sidebar_visible = False
        if layout.overlay_metrics:
            self.metrics_visible = False
        self.query_one(Composer).focus()

"""Which panels the chat screen shows at a given terminal width, and how.

The chat column must stay readable (about 50 columns or more): at 120 columns and up the
sidebar and the engine panel sit beside it; from 80 the sidebar stays and the engine panel
opens over the chat on demand (F3); below 80 both open over the chat on demand (Ctrl+B, F3)
and close with Esc. The footer turns compact below 120, and below 100 shows only the
essential keys, so that none is cut off.
"""

from __future__ import annotations

from dataclasses import dataclass

MEDIUM_WIDTH = 80
WIDE_WIDTH = 120
FULL_FOOTER_WIDTH = 100


@dataclass(frozen=True)
class PanelLayout:
    sidebar: bool
    """Sidebar shown when the layout is entered."""
    metrics: bool
    overlay_sidebar: bool
    """The sidebar opens over the chat (and closes after choosing a conversation)."""
    overlay_metrics: bool
    compact_footer: bool
    essential_footer: bool
    """Only the essential keys in the footer (F1 lists them all)."""


def layout_for(width: int, show_metrics: bool) -> PanelLayout:
    """The panel defaults for `width` columns; `show_metrics` is the user's saved choice for
    wide terminals (where the panel fits beside the chat)."""
    if width >= WIDE_WIDTH:
        return PanelLayout(True, show_metrics, False, False, False, False)
    if width >= MEDIUM_WIDTH:
        return PanelLayout(True, False, False, True, True, width < FULL_FOOTER_WIDTH)
    return PanelLayout(False, False, True, True, True, True)

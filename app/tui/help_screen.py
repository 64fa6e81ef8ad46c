"""The help screen: every key, with the user's keymap applied, grouped by where it works."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Label

from npuchat.app.tui.keys import effective_keys


def key_label(keys: str) -> str:
    """ "shift+enter,ctrl+j" -> "Shift+Enter / Ctrl+J"."""
    return " / ".join("+".join(p.capitalize() for p in k.split("+")) for k in keys.split(","))


def empty_hint(keymap: Mapping[str, str]) -> str:
    """The first-screen hint, naming the keys as the user's keymap has them."""
    keys = {row[3]: key_label(row[1]) for row in effective_keys(keymap)}
    return (
        "Ask anything.\n\n"
        f"{keys['send']} sends · {keys['newline']} new line\n"
        f"{keys['stop']} stops a reply · {keys['regenerate']} regenerates\n"
        f"{keys['command_palette']} commands · {keys['help']} keys · {keys['settings']} settings"
    )


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f1,q", "close", "Close", id="help_close"),
    ]

    def __init__(self, keymap: Mapping[str, str]) -> None:
        super().__init__(classes="dialog")
        self.keymap = keymap

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-body", id="help-body"):
            yield Label("Keys", classes="question")
            yield DataTable(cursor_type="none", zebra_stripes=True, id="keys")
            yield Label(
                "Tab / Shift+Tab move the focus: input, messages, chats. With a message focused,"
                " E / C / Y act on it; any other key you type goes to the input."
                '  Remap any key in config.toml under [keymap], e.g.  regenerate = "ctrl+g".'
                "  Click a code block to copy it.",
                classes="hint",
                markup=False,
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Where", "Key", "Action", "Id")
        for where, keys, description, binding_id in effective_keys(self.keymap):
            table.add_row(where, key_label(keys), description, binding_id)
        table.focus()

    def action_close(self) -> None:
        self.dismiss(None)
